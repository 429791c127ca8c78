"""The steps of one job on their own, without a broker: parse, check, run (the real toy engine)
and the reply, each against what PROTOCOL.md says it must produce."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from engine import GenerationOptions
from engine.errors import EngineFailure
from engine.options import DocumentTranslation, Hypothesis, SegmentResult, Translation
from engine.options import Usage as DocUsage
from worker.job import Job, Ran, Received, Refused, Unanswerable, check, ok_reply, parse
from worker.messages import OkReply, PartialReply, PartialSegment, dump_body, dump_reply, parse_reply
from worker.outcomes import Requeue
from worker.service import Service
from worker.settings import Settings

pytestmark = pytest.mark.timeout(60)

SETTINGS = Settings(_env_file=None, metrics_port=0)


def received(body: dict | bytes, reply_to: str | None = "replies", message_id: str | None = "mid",
             at: float | None = None) -> Received:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return Received(data, reply_to, message_id, time.time() if at is None else at)


def parse_body(r: Received):
    return parse(r, SETTINGS.max_message_bytes)


def body(**kw) -> dict:
    return {"v": 1, "id": "j1", "src_lang": "eng_Latn", "tgt_lang": "fra_Latn", "text": "hello", **kw}


def test_parse_needs_reply_to_and_a_valid_body():
    with pytest.raises(Unanswerable):
        parse_body(received(body(), reply_to=None))
    assert parse_body(received(body())).segments == ["hello"]
    with pytest.raises(Refused) as e:
        parse_body(received(body(colour="red")))
    assert (e.value.code, e.value.job_id) == ("invalid_request", "j1") and "colour" in e.value.message
    with pytest.raises(Refused) as e:
        parse_body(received(b"{nope"))
    assert e.value.reply("mid").id == "mid"  # no id in the body: the message_id answers
    with pytest.raises(Refused) as e:
        parse(received(body(text="x" * 100)), max_bytes=99)  # refused before it is parsed
    assert e.value.code == "too_long" and "at most 99 (NLLB_MAX_MESSAGE_BYTES)" in e.value.message


def test_check_resolves_languages_deadline_and_options():
    job = check(parse_body(received(body(options={"num_beams": 2}))), received(body()), SETTINGS)
    assert (job.id, job.src_lang, job.tgt_lang, job.segments) == ("j1", "eng_Latn", "fra_Latn", ["hello"])
    assert job.options == GenerationOptions(num_beams=2) and job.deadline is None
    assert check(parse_body(received(body())), received(body()), SETTINGS).options is None

    paired = Settings(_env_file=None, default_src_lang="eng_Latn", default_tgt_lang="deu_Latn")
    req = parse_body(received({"v": 1, "text": "hi"}))
    assert check(req, received(b"", message_id="m7"), paired).tgt_lang == "deu_Latn"
    empty = parse_body(received({"v": 1, "text": "hi", "tgt_lang": ""}))
    assert check(empty, received(b""), paired).tgt_lang == "", "an explicit language replaced by the default"
    with pytest.raises(Refused, match="NLLB_DEFAULT_SRC_LANG") as e:
        check(req, received(b"", message_id="m7"), SETTINGS)
    assert e.value.reply(None).id == "m7"


def test_jobs_with_the_same_options_share_them_and_a_bad_value_is_refused_every_time():
    def options(given: dict) -> GenerationOptions | None:
        return check(parse_body(received(body(options=given))), received(body()), SETTINGS).options

    first, second = options({"num_beams": 3, "max_new_tokens": 9}), options({"num_beams": 3, "max_new_tokens": 9})
    assert first is second and first == GenerationOptions(num_beams=3, max_new_tokens=9)
    assert options({"temperature": 0.5, "do_sample": True}) == GenerationOptions(temperature=0.5, do_sample=True)
    assert options({"num_beams": 2}) == GenerationOptions(num_beams=2)  # another set, its own options
    for _ in range(2):
        with pytest.raises(Refused, match="num_beams=0"):
            options({"num_beams": 0})


@pytest.mark.parametrize("kw, code, words", [
    ({"deadline_ms": 1000}, "deadline_exceeded", "before the job was received"),
    ({"text": None, "texts": ["a"] * 257}, "too_long", "NLLB_MAX_SEGMENTS"),
    ({"options": {"num_beams": 2, "num_return_sequences": 3}}, "invalid_request", "num_beams >="),
    ({"text": "x" * 50_001}, "too_long", "segment 0 has 50,001 characters"),
])
def test_check_refuses_naming_the_fault(kw, code, words):
    data = {k: v for k, v in body(**kw).items() if v is not None}
    with pytest.raises(Refused) as e:
        check(parse_body(received(data)), received(data), SETTINGS)
    assert e.value.code == code and words in e.value.message and e.value.job_id == "j1"


def test_ok_reply_shows_scores_tokens_and_hypotheses_only_when_asked():
    hyps = [Hypothesis("a", [5, 6], -0.5), Hypothesis("b", [7], -0.9)]
    translations = [Translation("a", [5, 6], -0.5, hyps, src_tokens=4), Translation("c", [8], -0.1, [], 3)]
    plain = check(parse_body(received(body())), received(body()), SETTINGS)
    reply = ok_reply(plain, Ran(translations, 0.002, 0.040), "toy")
    assert reply["translations"] == [{"text": "a", "hypotheses": [{"text": "a"}, {"text": "b"}]}, {"text": "c"}]
    assert reply["usage"] == {"src_tokens": 7, "tgt_tokens": 3}
    assert (reply["timings_ms"], reply["model"]) == ({"queued": 2.0, "compute": 40.0}, "toy")
    rich = body(options={"return_scores": True, "return_tokens": True})
    reply = ok_reply(check(parse_body(received(rich)), received(rich), SETTINGS), Ran(translations, 0, 0), "toy")
    assert reply["translations"][0]["hypotheses"][1] == {"text": "b", "score": -0.9, "tokens": [7]}


def _document(texts: list[str], warnings: list[list[str]]) -> DocumentTranslation:
    segments = [SegmentResult(t.upper(), Translation(t, [1, 2], -0.25, warnings=w, retried=bool(w)))
                for t, w in zip(texts, warnings)]
    return DocumentTranslation(" ".join(texts), segments, "eng_Latn", 0.912345,
                               DocUsage(len(texts), len(texts), 9, 4, 0.0, 0.01))


@pytest.mark.parametrize("options, answer", [
    ({}, [Translation("a", [5], -0.5, src_tokens=3)]),
    ({"return_scores": True, "return_tokens": True},
     [Translation("é ü", [5, 6], -1.25, [Hypothesis("é ü", [5, 6], -1.25), Hypothesis("b", [7], -2.0)], 4,
                  ["repetition", "off_target"], "fra_Latn", 0.87654321, True)]),
    ({"return_segments": True}, _document(["one.", "two!"], [[], ["truncated"]])),
    ({}, _document(["only"], [["length_ratio"]])),
])
def test_ok_reply_is_what_the_reply_model_writes(options, answer):
    """The reply is built as a plain dict on the hot path: it must be exactly what the protocol's model
    (messages.OkReply) holds and writes, byte for byte."""
    data = body(options=options, adapter="fra-reverse")
    job = check(parse_body(received(data)), received(data), SETTINGS)
    reply = ok_reply(job, Ran(answer, 0.0015, 0.0421), "toy")
    model = OkReply.model_validate(reply)
    assert model.model_dump(exclude_none=True) == reply
    assert dump_body(reply) == dump_reply(model)
    assert parse_reply(dump_body(reply)) == model


def test_every_reply_to_a_job_without_an_id_or_message_id_says_id_null():
    """PROTOCOL's reply shapes all carry "id": one for a job that named none has it null, never left out (a
    client's model of the reply requires the key)."""
    data = {k: v for k, v in body().items() if k != "id"}
    job = check(parse_body(received(data, message_id=None)), received(data, message_id=None), SETTINGS)
    assert job.id is None
    ok = dump_body(ok_reply(job, Ran([Translation("a", [5], -0.5, src_tokens=3)], 0.001, 0.002), "toy"))
    refused = Refused("too_long", "a segment is too long").reply(None)
    partial = PartialReply(id=None, done=1, total=2, segments=[PartialSegment(index=0, text="a")])
    for reply in (ok, dump_reply(refused), dump_reply(partial)):
        assert json.loads(reply)["id"] is None and list(json.loads(reply))[:2] == ["v", "id"]
        assert parse_reply(reply).id is None


class FailingEngine:
    """The real engine, failing every submit as a broken engine does."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def submit(self, *args, **kwargs):
        raise EngineFailure("injected")


def test_run_answers_refuses_or_requeues(engine):
    def job(tgt: str) -> Job:
        return Job("j1", parse_body(received(body())), ["hello world"], None, "eng_Latn", tgt, None, None)

    async def steps():
        svc = Service(SETTINGS, engine, owns_engine=False)
        ran = await svc._run(job("fra_Latn"), received(body()))
        assert [t.tokens for t in ran.answer] == [engine.translate(["hello world"], "eng_Latn",
                                                                         "fra_Latn")[0].tokens]
        assert ran.compute_s > 0 and ran.queued_s >= 0
        with pytest.raises(Refused) as e:
            await svc._run(job("xx_Latn"), received(body()))
        assert (e.value.code, e.value.job_id, e.value.retryable) == ("unknown_language", "j1", False)
        with pytest.raises(Requeue) as r:
            await Service(SETTINGS, FailingEngine(engine), owns_engine=False)._run(job("fra_Latn"),
                                                                                  received(body()))
        assert r.value.reason == "engine_failure"
    asyncio.run(asyncio.wait_for(steps(), 30))


def test_prefetch_defaults_to_twice_the_engines_rows_and_follows_the_setting(engine):
    """Jobs being parsed or answered hold prefetch slots but no rows: twice the rows keeps the table full."""
    async def prefetches() -> tuple[int, int]:
        default = Service(SETTINGS, engine, owns_engine=False).prefetch
        set_to_5 = Service(SETTINGS.model_copy(update={"prefetch": 5}), engine, owns_engine=False).prefetch
        return default, set_to_5
    assert asyncio.run(prefetches()) == (2 * engine.rows_total, 5)
