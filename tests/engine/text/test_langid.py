"""Language identification: accuracy per language on short sentences, the ISO -> FLORES table,
unknown_language answers (gibberish, a language NLLB lacks, low confidence), documents."""
from __future__ import annotations

import pytest

from engine.languages import FLORES_CODES
from engine.text.flores_map import BY_SCRIPT, ISO_TO_FLORES, to_flores
from engine.text.langid import DEFAULT_THRESHOLD, Detection, covers, detect, detect_document

# Three short everyday sentences per language, written for this test (same three meanings).
SAMPLES: dict[str, tuple[str, str, str]] = {
    "eng_Latn": ("The weather is lovely today.", "Where is the nearest train station?",
                 "I forgot my keys at home again."),
    "fra_Latn": ("Il fait très beau aujourd'hui.", "Où se trouve la gare la plus proche ?",
                 "J'ai encore oublié mes clés à la maison."),
    "deu_Latn": ("Das Wetter ist heute wunderschön.", "Wo ist der nächste Bahnhof?",
                 "Ich habe meine Schlüssel wieder zu Hause vergessen."),
    "spa_Latn": ("Hoy hace un tiempo estupendo.", "¿Dónde está la estación de tren más cercana?",
                 "Otra vez olvidé mis llaves en casa."),
    "ita_Latn": ("Oggi il tempo è bellissimo.", "Dov'è la stazione ferroviaria più vicina?",
                 "Ho dimenticato di nuovo le chiavi a casa."),
    "por_Latn": ("O tempo está lindo hoje.", "Onde fica a estação de comboios mais próxima?",
                 "Esqueci-me outra vez das chaves em casa."),
    "cat_Latn": ("Avui fa un temps magnífic.", "On és l'estació de tren més propera?",
                 "He tornat a oblidar les claus a casa."),
    "nld_Latn": ("Het weer is vandaag prachtig.", "Waar is het dichtstbijzijnde treinstation?",
                 "Ik ben mijn sleutels weer thuis vergeten."),
    "pol_Latn": ("Dzisiaj jest piękna pogoda.", "Gdzie jest najbliższa stacja kolejowa?",
                 "Znowu zapomniałem kluczy z domu."),
    "ces_Latn": ("Dnes je krásné počasí.", "Kde je nejbližší nádraží?", "Zase jsem zapomněl klíče doma."),
    "swe_Latn": ("Vädret är underbart i dag.", "Var ligger närmaste tågstation?",
                 "Jag glömde mina nycklar hemma igen."),
    "dan_Latn": ("Vejret er dejligt i dag.", "Hvor ligger den nærmeste togstation?",
                 "Jeg har glemt mine nøgler derhjemme igen."),
    "nob_Latn": ("Været er nydelig i dag.", "Hvor ligger nærmeste togstasjon?",
                 "Jeg glemte nøklene mine hjemme igjen."),
    "fin_Latn": ("Tänään on kaunis sää.", "Missä on lähin rautatieasema?", "Unohdin taas avaimeni kotiin."),
    "hun_Latn": ("Ma nagyon szép idő van.", "Hol van a legközelebbi vasútállomás?",
                 "Megint otthon felejtettem a kulcsaimat."),
    "tur_Latn": ("Bugün hava çok güzel.", "En yakın tren istasyonu nerede?", "Anahtarlarımı yine evde unuttum."),
    "ron_Latn": ("Astăzi vremea este minunată.", "Unde este cea mai apropiată gară?",
                 "Mi-am uitat din nou cheile acasă."),
    "vie_Latn": ("Hôm nay thời tiết rất đẹp.", "Ga tàu gần nhất ở đâu?", "Tôi lại quên chìa khóa ở nhà rồi."),
    "ind_Latn": ("Cuaca hari ini sangat cerah.", "Di mana stasiun kereta terdekat?",
                 "Saya lupa kunci saya di rumah lagi."),
    "swh_Latn": ("Hali ya hewa ni nzuri sana leo.", "Kituo cha treni kilicho karibu kiko wapi?",
                 "Nimesahau funguo zangu nyumbani tena."),
    "rus_Cyrl": ("Сегодня прекрасная погода.", "Где находится ближайший вокзал?", "Я опять забыл ключи дома."),
    "ukr_Cyrl": ("Сьогодні чудова погода.", "Де знаходиться найближчий вокзал?", "Я знову забув ключі вдома."),
    "bul_Cyrl": ("Днес времето е прекрасно.", "Къде е най-близката гара?", "Отново забравих ключовете си вкъщи."),
    "srp_Cyrl": ("Данас је време веома лепо.", "Где је најближа железничка станица?",
                 "Поново сам заборавио кључеве код куће."),
    "ell_Grek": ("Ο καιρός είναι υπέροχος σήμερα.", "Πού είναι ο πλησιέστερος σιδηροδρομικός σταθμός;",
                 "Ξέχασα πάλι τα κλειδιά μου στο σπίτι."),
    "arb_Arab": ("الطقس جميل جدا اليوم.", "أين تقع أقرب محطة قطار؟", "نسيت مفاتيحي في المنزل مرة أخرى."),
    "pes_Arab": ("امروز هوا خیلی خوب است.", "نزدیک‌ترین ایستگاه قطار کجاست؟",
                 "دوباره کلیدهایم را در خانه جا گذاشتم."),
    "urd_Arab": ("آج موسم بہت اچھا ہے۔", "قریب ترین ریلوے اسٹیشن کہاں ہے؟",
                 "میں پھر سے اپنی چابیاں گھر پر بھول گیا۔"),
    "heb_Hebr": ("מזג האוויר נהדר היום.", "איפה תחנת הרכבת הקרובה ביותר?", "שכחתי שוב את המפתחות בבית."),
    "hin_Deva": ("आज मौसम बहुत अच्छा है।", "सबसे नज़दीकी रेलवे स्टेशन कहाँ है?",
                 "मैं फिर से अपनी चाबियाँ घर पर भूल गया।"),
    "ben_Beng": ("আজ আবহাওয়া খুব সুন্দর।", "সবচেয়ে কাছের রেল স্টেশন কোথায়?", "আমি আবার বাড়িতে চাবি ভুলে গেছি।"),
    "tam_Taml": ("இன்று வானிலை மிகவும் நன்றாக உள்ளது.", "அருகிலுள்ள ரயில் நிலையம் எங்கே?",
                 "நான் மீண்டும் என் சாவிகளை வீட்டில் மறந்துவிட்டேன்."),
    "tha_Thai": ("วันนี้อากาศดีมาก", "สถานีรถไฟที่ใกล้ที่สุดอยู่ที่ไหน", "ฉันลืมกุญแจไว้ที่บ้านอีกแล้ว"),
    "zho_Hans": ("今天天气很好。", "最近的火车站在哪里？", "我又把钥匙忘在家里了。"),
    "zho_Hant": ("今天天氣很好。", "最近的火車站在哪裡？", "我又把鑰匙忘在家裡了。"),
    "jpn_Jpan": ("今日はとても良い天気です。", "一番近い駅はどこですか？", "また鍵を家に忘れてしまいました。"),
    "kor_Hang": ("오늘 날씨가 정말 좋네요.", "가장 가까운 기차역이 어디에 있나요?", "또 열쇠를 집에 두고 왔어요."),
    "kat_Geor": ("დღეს ძალიან კარგი ამინდია.", "სად არის უახლოესი რკინიგზის სადგური?",
                 "ისევ დამავიწყდა გასაღებები სახლში."),
    "hye_Armn": ("Այսօր եղանակը շատ լավ է։", "Որտե՞ղ է մոտակա երկաթուղային կայարանը։",
                 "Ես նորից մոռացել եմ բանալիները տանը։"),
}


def test_the_identifier_ranks_as_py3langid_does() -> None:
    """Scored from the library's arrays (engine.text.langid._Scorer), the three best labels and their
    probabilities are py3langid's own `rank`'s, bit for bit, on every sample, on upper-case, mixed and
    featureless text, and on text that needs NFC."""
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    from engine.text.langid import _model

    library = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
    texts = [t for three in SAMPLES.values() for t in three]
    texts += ["THE WEATHER IS LOVELY TODAY.", "Cafe\u0301 au lait, s'il vous plai\u0302t", "12345 !!!", "",
              "qwzx vbnm plkj", "Hello Привет 你好 مرحبا", "a" * 3000, "Ünïcödé \ud800 lone surrogate"]
    for text in texts:
        assert _model().best(text, 3) == [(iso, float(p)) for iso, p in library.rank(text)[:3]], text
    assert _model().labels == tuple(library.labels)


@pytest.mark.parametrize("code", sorted(SAMPLES))
def test_detects_at_least_two_of_three_short_sentences_per_language(code: str) -> None:
    found = [detect(s).lang for s in SAMPLES[code]]
    assert sum(f == code for f in found) >= 2, found


def test_detects_over_nine_in_ten_short_sentences_overall() -> None:
    pairs = [(code, s) for code, sents in SAMPLES.items() for s in sents]
    hits = sum(detect(s).lang == code for code, s in pairs)
    assert len(SAMPLES) >= 25
    assert hits / len(pairs) >= 0.9, f"{hits}/{len(pairs)}"


def test_every_sample_language_is_covered() -> None:
    assert all(covers(code) for code in SAMPLES)


@pytest.mark.parametrize("iso", sorted(ISO_TO_FLORES))
def test_iso_table_names_nllb_codes(iso: str) -> None:
    target = ISO_TO_FLORES[iso]
    assert target is None or target in FLORES_CODES
    assert to_flores(iso, "") == target


@pytest.mark.parametrize("iso", sorted(BY_SCRIPT))
def test_script_dependent_codes_name_nllb_codes(iso: str) -> None:
    table, default = BY_SCRIPT[iso]
    assert default in FLORES_CODES and set(table.values()) <= set(FLORES_CODES)


@pytest.mark.parametrize(("iso", "text", "want"), [
    ("zh", "今天天气很好，我们去公园吧。", "zho_Hans"),
    ("zh", "今天天氣很好，我們去公園吧。", "zho_Hant"),
    ("zho", "這個問題很難。", "zho_Hant"),
    ("sr", "Данас је лепо време.", "srp_Cyrl"),
    ("sr", "Danas je lepo vreme.", "srp_Cyrl"),  # NLLB has Serbian only as srp_Cyrl
    ("sh", "Danas je lijepo vrijeme.", "hrv_Latn"),
    ("sh", "Данас је лепо време.", "srp_Cyrl"),
    ("az", "Bu gün hava gözəldir.", "azj_Latn"),
    ("az", "بو گون هاوا گوزلدیر", "azb_Arab"),
    ("ku", "Îro hewa xweş e.", "kmr_Latn"),
    ("ku", "ئەمڕۆ کەشوهەوا خۆشە", "ckb_Arab"),
    ("ar", "", "arb_Arab"), ("no", "", "nob_Latn"), ("nb", "", "nob_Latn"), ("nn", "", "nno_Latn"),
    ("fa", "", "pes_Arab"), ("ms", "", "zsm_Latn"), ("sq", "", "als_Latn"), ("FR", "", "fra_Latn"),
    ("fra", "", "fra_Latn"), ("kas", "कॉशुर", "kas_Deva"), ("kas", "کٲشُر", "kas_Arab"),
    ("als", "", None),  # fastText's Alemannic, not Tosk Albanian
    ("la", "", None), ("br", "", None), ("zxx", "", None), ("xx", "", None),
])
def test_to_flores_reads_the_script_where_nllb_needs_it(iso: str, text: str, want: str | None) -> None:
    assert to_flores(iso, text) == want


@pytest.mark.parametrize("text", ["asdkj qwpoe zxmcn vbnlk", "xkcd qzx vvv jjj wwp", "12345 !!! ???", ""])
def test_gibberish_is_unknown(text: str) -> None:
    assert detect(text).lang is None


@pytest.mark.parametrize(("text", "iso"), [
    ("Gallia est omnis divisa in partes tres, quarum unam incolunt Belgae.", "la"),
    ("Ar gêr a zo bras ha brav, hag ar bobl a zo laouen.", "br"),
])
def test_a_language_nllb_lacks_is_unknown_with_best_guesses(text: str, iso: str) -> None:
    found = detect(text)
    assert found.lang is None
    assert found.guesses[0][0] == iso and found.confidence > DEFAULT_THRESHOLD
    assert 1 <= len(found.guesses) <= 3
    assert [p for _, p in found.guesses] == sorted((p for _, p in found.guesses), reverse=True)


def test_below_the_threshold_is_unknown_with_the_guess_kept() -> None:
    text = "Bonjour"  # one word: the identifier leans French but is not sure
    loose, strict = detect(text, threshold=0.0), detect(text, threshold=0.99)
    assert loose.lang == "fra_Latn" and strict.lang is None
    assert strict.guesses == loose.guesses and strict.confidence == loose.confidence


def test_document_detection_reads_the_long_sentences_not_the_short_lines() -> None:
    long = ["Das Wetter ist heute wunderschön, und deshalb gehen wir am Nachmittag lange spazieren.",
            "Danach treffen wir uns mit unseren alten Freunden im kleinen Café direkt am Marktplatz.",
            "Am Abend kochen wir zusammen, hören Musik und reden über die Pläne für den nächsten Urlaub.",
            "Vielleicht fahren wir im Sommer wieder an die Ostsee, wenn die Kinder Ferien haben."]
    sentences = ["Berlin", "ISBN 978-3", "OK", *long]
    found = detect_document(sentences)
    assert found == detect(" ".join(sorted(long, key=len, reverse=True)))
    assert found.lang == "deu_Latn" and found.confidence > 0.9


def test_document_without_language_is_unknown() -> None:
    assert detect_document(["12", "--", "3.5"]) == Detection(None, 0.0, ())
