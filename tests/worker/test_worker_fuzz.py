"""Whatever a producer sends is answered: random bytes, random JSON, and mutated jobs through a real
broker each get exactly one reply (a translation or a PROTOCOL.md error), or, without reply_to, end
in the dead-letter queue; the worker never crashes or stalls, and the jobs queue ends empty."""
from __future__ import annotations

import json
import random

import pytest
from conftest import run, settled_counts
from helpers import PlainProducer, in_process_worker, job

from worker.messages import JobOptions

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(300)]

CODES = {"invalid_request", "unknown_language", "unknown_adapter", "too_long", "deadline_exceeded",
         "overloaded", "internal"}
OPTION_NAMES = [*JobOptions.model_fields, "typo_field"]


# Strings JSON carries but Unicode does not allow (json.dumps writes them as \\u escapes): lone high
# and low surrogates, a reversed pair, a surrogate beside a real pair, noncharacters (allowed).
INVALID_UNICODE = ["a\ud800b", "\udc00", "\ude00\ud83d", "😀\udbff", "x\ufffe\uffff"]
# Bodies whose bytes are not UTF-8: a surrogate encoded as UTF-8 (CESU), an overlong '/', a cut
# sequence, a byte order mark before the JSON.
INVALID_UTF8 = [b'{"v": 1, "text": "\xed\xa0\x80"}', b'{"v": 1, "text": "\xc0\xaf"}', b'{"v": 1, "text": "\xe2\x82"}',
                b'\xef\xbb\xbf{"v": 1, "text": "x"}']


def random_value(rng: random.Random, depth: int = 0):
    kinds = ["int", "float", "str", "bool", "none"] + (["list", "dict"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.choice([0, 1, -1, 2, 7, 64, 65, 10**6, -(2**63), 2**64])
    if kind == "float":
        return rng.choice([0.0, 0.5, 1.0, -3.2, 1e308, 1e-9])
    if kind == "str":
        return rng.choice(["", " ", "eng_Latn", "fra_Latn", "xx_Latn", "ta deshacho", "é\u0000😀", "a" * 3000,
                           *INVALID_UNICODE])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "none":
        return None
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["v", "id", "texts", "text", "options", "x"]): random_value(rng, depth + 1)
            for _ in range(rng.randint(0, 3))}


def mutated_job(rng: random.Random) -> dict:
    body = job(["ta deshacho lidor", "kadera"], tgt=rng.choice(["fra_Latn", "deu_Latn"]),
               options={name: random_value(rng) for name in rng.sample(OPTION_NAMES, rng.randint(0, 4))})
    for _ in range(rng.randint(0, 2)):
        key = rng.choice(["v", "id", "src_lang", "tgt_lang", "texts", "text", "document", "adapter", "deadline_ms",
                          "extra"])
        if rng.random() < 0.3:
            body.pop(key, None)
        else:
            body[key] = random_value(rng)
    return body


def random_message(rng: random.Random) -> bytes:
    pick = rng.random()
    if pick < 0.05:
        return rng.choice(INVALID_UTF8)
    if pick < 0.1:
        body = job(["ta deshacho", rng.choice(INVALID_UNICODE)])
        return json.dumps({rng.choice(INVALID_UNICODE) if rng.random() < 0.3 else "extra": 1, **body}
                          if rng.random() < 0.3 else body).encode()
    if pick < 0.2:
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
    if pick < 0.4:
        return json.dumps(random_value(rng)).encode()
    return json.dumps(mutated_job(rng)).encode()


def test_every_random_message_gets_one_reply_or_a_dead_letter(settings, names, engine, broker):
    rng = random.Random(20261129)
    answerable = [random_message(rng) for _ in range(150)]
    unanswerable = [random_message(rng) for _ in range(20)]

    async def body():
        async with in_process_worker(settings, engine) as svc, \
                PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            cids = [await p.publish(data) for data in answerable]
            for i, data in enumerate(unanswerable):
                await p.publish(data, reply=False, message_id=f"dead-{i}")
            await p.wait_for(cids, 240)
            outcomes: dict[str, int] = {}
            for cid in cids:
                assert len(p.replies[cid]) == 1, "a job was answered twice without any fault"
                reply = p.replies[cid][0]
                outcome = "ok" if reply["status"] == "ok" else reply["error"]["code"]
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
                if reply["status"] == "error":
                    assert reply["error"]["message"]
            surrogates = sum("lone surrogate" in p.replies[c][0].get("error", {}).get("message", "") for c in cids)
            print(f"\nfuzz outcomes: {outcomes}; lone surrogates named: {surrogates}")
            assert surrogates >= 5, "the invalid-Unicode classes were not drawn"
            assert set(outcomes) <= CODES | {"ok"}
            assert "internal" not in outcomes, "an input reached an untyped failure"
            assert outcomes.get("ok", 0) >= 5 and outcomes.get("invalid_request", 0) >= 50
            # without reply_to: a valid job is still unanswerable, so all of them are dead-lettered
            dead = await p.dead_letters(names["dead_letter_queue"], len(unanswerable), 60)
            assert {m.message_id for m in dead} == {f"dead-{i}" for i in range(len(unanswerable))}
            assert (await p.one(job("kadera")))["status"] == "ok"  # and it still serves
            assert svc.engine.is_alive()
        assert settled_counts(names["jobs_queue"]) == (0, 0)
    run(body(), 280)
