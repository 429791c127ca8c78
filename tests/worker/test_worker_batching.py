"""The worker's batched hand-offs against a real broker: acks sent in batches still follow each job's
confirmed reply, and a multiple ack never covers a delivery that is settled otherwise."""
from __future__ import annotations

import asyncio
import itertools
import time

from conftest import run, settled_counts
from helpers import PlainProducer, eventually, in_process_worker, job

from worker.acks import _ChannelTags, ack_frames
from worker.amqp import Published


def test_batched_acks_follow_confirmed_replies_and_spare_rejected_deliveries(settings, names, engine, broker):
    """Many jobs at once, of many lengths, every fifth without reply_to (dead-lettered by reject): every acked
    delivery's reply
    was confirmed before the ack that covered it went out; a multiple ack covered only deliveries whose replies
    were confirmed; the rejected ones reached the dead-letter queue; and acks did go out in batches."""
    n = 200
    settings = settings.model_copy(update={"prefetch": 64})

    async def body():
        async with in_process_worker(settings, engine) as svc, \
                PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            clock = itertools.count()
            confirmed: dict[int, int] = {}  # delivery tag -> when its reply's confirm came
            delivered: set[int] = set()
            settles: list[tuple[str, int, bool, int]] = []  # (method, tag, multiple, when)
            publish, on_message = svc._publish, svc._on_message

            async def recording_publish(message, reply, outcome):
                result = await publish(message, reply, outcome)
                if result.outcome.value == "ok":
                    confirmed[message.delivery_tag] = next(clock)
                return result

            def recording_on_message(message):
                delivered.add(message.delivery_tag)
                channel = message.channel
                if not getattr(channel, "recorded", False):
                    basic_ack, basic_reject = channel.basic_ack, channel.basic_reject

                    async def recording_ack(tag, multiple=False, wait=True):
                        settles.append(("ack", tag, multiple, next(clock)))
                        return await basic_ack(tag, multiple=multiple, wait=wait)

                    async def recording_reject(delivery_tag, **kw):
                        settles.append(("reject", delivery_tag, False, next(clock)))
                        return await basic_reject(delivery_tag=delivery_tag, **kw)
                    channel.basic_ack, channel.basic_reject, channel.recorded = recording_ack, recording_reject, True
                on_message(message)

            svc._publish = recording_publish
            await svc.broker.cancel()  # consume again through the recorders
            svc._on_message = recording_on_message
            await svc.broker.consume(svc._on_message, svc._on_channel_lost)

            published = await asyncio.gather(*(  # of many lengths: they finish out of order
                p.publish(job(f"rema sila {i}", options={"max_new_tokens": 1 + i * 7 % 13}), reply=i % 5 != 0)
                for i in range(n)))
            answered = [cid for i, cid in enumerate(published) if i % 5 != 0]
            await p.wait_for(answered, 60)
            await eventually(lambda: svc.metrics.count("dead_letter", "unanswerable") == n // 5, 30,
                             "the rejects")
            await eventually(lambda: svc.metrics.count("ok") == len(answered), 10, "the acks")

        outstanding, rejected = set(delivered), set()
        for method, tag, multiple, when in settles:  # replayed as the broker saw them
            assert tag in outstanding, f"{method} of {tag}, which an earlier ack covered"
            if method == "reject":
                rejected.add(tag)
                outstanding.discard(tag)
                continue
            covered = {t for t in outstanding if t <= tag} if multiple else {tag}
            assert all(t in confirmed and confirmed[t] < when for t in covered), \
                f"ack of {tag} (multiple={multiple}) covers a delivery whose reply was not confirmed first"
            outstanding -= covered
        assert not outstanding and rejected == set(delivered) - set(confirmed) and len(rejected) == n // 5
        acks = [s for s in settles if s[0] == "ack"]
        assert len(acks) < len(confirmed)  # batched: fewer ack frames than acked deliveries
        assert settled_counts(names["jobs_queue"]) == (0, 0)
        assert settled_counts(names["dead_letter_queue"], (n // 5, 0)) == (n // 5, 0)
    run(body(), 120)


def test_publish_reports_a_reply_to_a_missing_queue_as_returned(settings, names, engine, broker):
    """The reply goes out on the confirming channel directly: a reply queue that is gone still comes back
    as returned (mandatory), one that exists is confirmed."""
    async def body():
        async with in_process_worker(settings, engine) as svc, \
                PlainProducer(broker, names["jobs_queue"], names["reply_queue"]):
            t0 = time.monotonic()
            assert await svc.broker.publish(b"{}", "no-such-queue-" + names["reply_queue"],
                                            correlation_id="x") is Published.RETURNED
            assert await svc.broker.publish(b"{}", names["reply_queue"], correlation_id="y") is Published.CONFIRMED
            assert time.monotonic() - t0 < 10
    run(body(), 60)


def settled_tags(upto: int, above: tuple[int, ...] = ()) -> _ChannelTags:
    tags = _ChannelTags()
    for tag in (*range(1, upto + 1), *above):
        tags.settle(tag)
    return tags


def test_ack_frames_use_multiple_only_over_tags_asked_or_settled_from_the_first_unsettled_tag():
    assert ack_frames(settled_tags(4), [5, 6, 7, 9]) == [(7, True, [5, 6, 7]), (9, False, [9])]
    assert ack_frames(settled_tags(4), [6, 7, 8]) == [(6, False, [6]), (7, False, [7]), (8, False, [8])]  # 5 runs
    assert ack_frames(settled_tags(4), [5, 7]) == [(5, False, [5]), (7, False, [7])]  # a run of one is plain
    assert ack_frames(settled_tags(0), [1, 2]) == [(2, True, [1, 2])]
    assert ack_frames(settled_tags(3), []) == []
    # 6 and 7 were settled before (rejected, say): the multiple ack reaches past them
    assert ack_frames(settled_tags(4, (6, 7)), [5, 8, 10]) == [(8, True, [5, 8]), (10, False, [10])]
