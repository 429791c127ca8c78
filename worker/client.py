"""The producer side of PROTOCOL.md: publish jobs, await replies by correlation id.

    async with NllbClient(url) as client:
        reply = await client.translate(["Hello."], "eng_Latn", "fra_Latn", timeout=30)

Replies arrive on one reply queue per client: by default an exclusive, server-named queue;
pass `reply_queue="name"` for a durable named queue that outlives connection drops (the caller
deletes it). Delivery is at least once: a job may be answered twice; the second reply is dropped
and counted in `duplicates` (the last MAX_ANSWERED answered ids are remembered for that; a duplicate
of an older one counts as `late`). Replies to jobs nobody waits for any more (timed out) count as `late`.
Interim `partial` messages of a job go to its `on_progress` callback, or are dropped without one: a
job's future is only ever resolved by its final reply, which always comes last. `cancel(job_id)`
asks the workers to drop a job (docs/protocol.md).

Every failure of the client itself is a ClientError, with the `code` and `retryable` of an error reply:
JobNotRouted, QueueFull, BrokerUnavailable (the job could not be published, or the cancel not confirmed, within
the call's timeout), MalformedReply.
"""
from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import json
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import aio_pika
from aio_pika.abc import AbstractIncomingMessage
from aio_pika.exceptions import ChannelNotFoundEntity, DeliveryError, PublishError
from pydantic import ValidationError

from worker.amqp import CONNECTION_ERRORS
from worker.messages import ErrorReply, OkReply, PartialReply, clip, reply_of


class ClientError(Exception):
    """A job or cancel the client could not see through; `code` and `retryable` as in an error reply."""

    code = "client_error"
    retryable = False


class JobNotRouted(ClientError):
    """The jobs queue does not exist (the broker returned the job): start a worker first."""

    code = "not_routed"
    retryable = True


class QueueFull(ClientError):
    """The broker refused the job (x-overflow=reject-publish: the queue is at its length limit).
    Retryable: back off and publish again."""

    code = "overloaded"
    retryable = True


class BrokerUnavailable(ClientError):
    """The broker could not be reached (or did not confirm) within the call's timeout. Retryable; a job whose
    confirm was lost may have been queued all the same, so publishing it again can answer it twice."""

    code = "broker_unavailable"
    retryable = True


class MalformedReply(ClientError):
    """The job's final reply is not one docs/protocol.md allows: not a JSON object, or an `ok` or `error` reply
    without its fields or of another major version. `body` holds its first MAX_MALFORMED_BYTES bytes."""

    code = "malformed_reply"

    def __init__(self, body: bytes, problem: str) -> None:
        self.body = body[:MAX_MALFORMED_BYTES]
        clipped = "" if len(body) <= MAX_MALFORMED_BYTES else f"... ({len(body)} bytes)"
        super().__init__(f"the job's reply is malformed ({problem}): {self.body!r}{clipped}")


CONTROL_EXCHANGE = "nllb.control"  # fanout: cancels reach every worker
MAX_ANSWERED = 100_000  # answered correlation ids remembered to tell duplicates (the oldest are forgotten)
MAX_MALFORMED_BYTES = 200  # of a malformed reply's body, kept in its MalformedReply
PUBLISH_ATTEMPT_S = 30.0  # one publish's wait for the broker's confirm
RETRY_PAUSE_S = 0.2  # between publishes while the connection is down
FINAL_STATUSES = ("ok", "error")

OnProgress = Callable[[dict[str, Any]], None]  # a `partial` message's JSON object


class NllbClient:
    """A producer: `publish` jobs and `wait` for their final replies, or `translate` for both.

    A final reply that is malformed (see MalformedReply) fails its job's future with MalformedReply: the job was
    answered, badly, and waiting on would only end in a timeout; a later well-formed reply to it counts as a
    duplicate. A message of the job whose `status` is a string other than ok, error and partial is taken for an
    interim message of a later protocol version: it is counted in `ignored`, and the wait goes on.
    """

    def __init__(self, url: str = "amqp://guest:guest@127.0.0.1:5672/",
                 jobs_queue: str = "nllb.jobs", reply_queue: str | None = None,
                 name: str = "nllb-client", reconnect_interval: float = 1.0,
                 control_exchange: str = CONTROL_EXCHANGE) -> None:
        self.url = url
        self.jobs_queue = jobs_queue
        self.control_exchange = control_exchange
        self.reply_queue_name = reply_queue
        self.name = name
        self.reconnect_interval = reconnect_interval
        self.connection: aio_pika.abc.AbstractRobustConnection | None = None
        self._channel: aio_pika.abc.AbstractRobustChannel | None = None
        self._reply_queue: aio_pika.abc.AbstractRobustQueue | None = None
        self._pending: dict[str, asyncio.Future] = {}  # correlation id -> its job's future, until it is done
        self._progress: dict[str, OnProgress] = {}
        self._answered: OrderedDict[str, None] = OrderedDict()  # the last MAX_ANSWERED answered ids, oldest first
        self.duplicates = 0
        self.late = 0
        self.replies = 0
        self.ignored = 0

    async def __aenter__(self) -> NllbClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def reply_to(self) -> str:
        assert self._reply_queue is not None
        return self._reply_queue.name

    @property
    def in_flight(self) -> int:
        """Jobs published whose future is not done yet."""
        return len(self._pending)

    async def connect(self) -> None:
        self.connection = await aio_pika.connect_robust(
            self.url, reconnect_interval=self.reconnect_interval,
            client_properties={"connection_name": self.name})
        self._channel = await self.connection.channel(publisher_confirms=True, on_return_raises=True)
        if self.reply_queue_name:
            self._reply_queue = await self._channel.declare_queue(self.reply_queue_name, durable=True)
        else:
            self._reply_queue = await self._channel.declare_queue(exclusive=True, auto_delete=True)
        await self._reply_queue.consume(self._on_reply)

    async def consumer_count(self) -> int:
        """Workers consuming the jobs queue now (a passive declare: nothing is created).
        JobNotRouted when the queue does not exist."""
        assert self.connection is not None
        channel = await self.connection.channel()  # a failed passive declare closes its channel
        try:
            queue = await channel.declare_queue(self.jobs_queue, passive=True)
        except ChannelNotFoundEntity:
            raise JobNotRouted(self._no_queue()) from None
        count = queue.declaration_result.consumer_count
        await channel.close()
        return count

    def _no_queue(self) -> str:
        return f"queue {self.jobs_queue!r} does not exist: start a worker with `nllb-worker run`"

    async def close(self) -> None:
        for fut in list(self._pending.values()):
            fut.cancel()
        if self.connection is not None:
            await self.connection.close()

    async def cancel(self, job_id: str, timeout: float = 30.0) -> None:
        """Publish a cancel for `job_id` to the control exchange (confirmed). The worker holding the job
        frees its rows and answers it `cancelled`; an unknown or finished id is ignored. JobNotRouted
        when the exchange does not exist (no worker has declared it); BrokerUnavailable when the cancel is
        not confirmed within `timeout` seconds."""
        assert self.connection is not None
        # UTF-8, not \uXXXX escapes: the longest id (512 astral characters) is then 2 KiB, not 6
        body = json.dumps({"v": 1, "cancel": job_id}, ensure_ascii=False).encode()
        try:
            await asyncio.wait_for(self._publish_control(body), timeout)
        except CONNECTION_ERRORS as e:
            raise BrokerUnavailable(f"the cancel for job {clip(job_id)!r} was not confirmed within {timeout:g} s "
                                    f"({type(e).__name__})") from None

    async def _publish_control(self, body: bytes) -> None:
        assert self.connection is not None
        channel = await self.connection.channel(publisher_confirms=True)
        try:
            exchange = await channel.get_exchange(self.control_exchange, ensure=True)  # passive
        except ChannelNotFoundEntity:
            raise JobNotRouted(f"exchange {self.control_exchange!r} does not exist: start a worker with "
                               "`nllb-worker run`") from None
        await exchange.publish(aio_pika.Message(body, content_type="application/json"), routing_key="")
        await channel.close()

    async def _on_reply(self, message: AbstractIncomingMessage) -> None:
        self._take_reply(message.correlation_id, message.body)
        await message.ack()

    def _take_reply(self, cid: str | None, body: bytes) -> None:
        """Route one message from the reply queue: progress, interim, or a job's final reply (class docstring)."""
        data = _json_object(body)
        status = data.get("status") if data is not None else None
        if status == "partial":  # never the final reply, whether or not someone asked for it
            if cid in self._progress:
                with contextlib.suppress(Exception):  # a caller's callback must not stop the replies
                    self._progress[cid](data)
            return
        if isinstance(status, str) and status not in FINAL_STATUSES:
            self.ignored += 1
            return
        fut = self._pending.get(cid) if cid else None
        if fut is None or fut.done():
            if cid in self._answered:
                self.duplicates += 1
            else:
                self.late += 1
            return
        self.replies += 1
        self._remember_answered(cid)
        try:
            fut.set_result(_final_reply(body, data))
        except MalformedReply as e:
            fut.set_exception(e)

    def _remember_answered(self, cid: str) -> None:
        self._answered.pop(cid, None)
        self._answered[cid] = None
        if len(self._answered) > MAX_ANSWERED:
            self._answered.popitem(last=False)

    def _forget(self, cid: str, fut: asyncio.Future) -> None:
        """A job's future is done (answered, failed, timed out or cancelled): it waits for nothing any more."""
        if self._pending.get(cid) is fut:
            del self._pending[cid]
            self._progress.pop(cid, None)

    async def publish(self, body: dict[str, Any] | bytes, *, correlation_id: str | None = None,
                      message_id: str | None = None, expiration_ms: int | None = None,
                      timeout: float | None = 60.0, on_progress: OnProgress | None = None) -> asyncio.Future:
        """Publish one job (persistent, confirmed, mandatory); return the future of its final reply.
        `on_progress` gets each `partial` message of the job (option "progress": true). Through a lost
        connection the job is published again until `timeout` seconds have passed (None: no limit), then
        BrokerUnavailable. ValueError when `correlation_id` is that of a job still pending."""
        assert self._channel is not None
        cid = correlation_id or uuid.uuid4().hex
        if cid in self._pending and not self._pending[cid].done():
            raise ValueError(f"correlation id {clip(cid)!r} is that of a job still waiting for its reply")
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        fut = asyncio.get_running_loop().create_future()
        self._pending[cid] = fut
        if on_progress is not None:
            self._progress[cid] = on_progress
        fut.add_done_callback(functools.partial(self._forget, cid))
        try:
            await self._publish_job(data, cid, message_id, expiration_ms, timeout)
        except BaseException:
            fut.cancel()
            self._forget(cid, fut)  # now, not when the loop runs the future's callbacks
            raise
        return fut

    async def _publish_job(self, data: bytes, cid: str, message_id: str | None, expiration_ms: int | None,
                           timeout: float | None) -> None:
        assert self._channel is not None
        loop = asyncio.get_running_loop()
        give_up = None if timeout is None else loop.time() + timeout
        while True:
            msg = aio_pika.Message(
                data, content_type="application/json", correlation_id=cid,
                message_id=message_id or cid, reply_to=self.reply_to,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                timestamp=dt.datetime.now(dt.timezone.utc),
                expiration=dt.timedelta(milliseconds=expiration_ms) if expiration_ms else None)
            left = PUBLISH_ATTEMPT_S if give_up is None else max(0.0, give_up - loop.time())
            try:
                # wait_for: while the connection is down, the robust channel waits for it without a limit
                await asyncio.wait_for(self._channel.default_exchange.publish(
                    msg, routing_key=self.jobs_queue, mandatory=True), min(PUBLISH_ATTEMPT_S, left))
                return
            except PublishError:
                raise JobNotRouted(self._no_queue()) from None
            except DeliveryError:
                raise QueueFull(f"the broker refused the job: queue {self.jobs_queue!r} is full; "
                                f"retry later") from None
            except CONNECTION_ERRORS as e:
                if give_up is not None and loop.time() + RETRY_PAUSE_S >= give_up:
                    raise BrokerUnavailable(f"the job was not published within {timeout:g} s: the broker is "
                                            f"unreachable or did not confirm ({type(e).__name__})") from None
                await asyncio.sleep(RETRY_PAUSE_S)

    async def wait(self, fut: asyncio.Future, timeout: float | None) -> OkReply | ErrorReply:
        """The job's final reply. asyncio.TimeoutError after `timeout` seconds (None: no limit), and then the
        job's future is cancelled: a reply that comes later counts as `late`. MalformedReply: see the class."""
        return await asyncio.wait_for(fut, timeout)

    async def translate(self, texts: list[str] | str, src_lang: str | None = None,
                        tgt_lang: str | None = None, *, adapter: str | None = None,
                        options: dict[str, Any] | None = None, deadline_ms: int | None = None,
                        job_id: str | None = None, timeout: float | None = 60.0
                        ) -> OkReply | ErrorReply:
        """Publish one job and wait for its reply, `timeout` seconds at most for both together:
        BrokerUnavailable when it could not be published by then, asyncio.TimeoutError when it was not
        answered by then."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        fut = await self.publish(self.job_body(texts, src_lang, tgt_lang, adapter=adapter,
                                               options=options, deadline_ms=deadline_ms,
                                               job_id=job_id), timeout=timeout)
        return await self.wait(fut, None if timeout is None else max(0.0, started + timeout - loop.time()))

    @staticmethod
    def job_body(texts: list[str] | str | None, src_lang: str | None = None, tgt_lang: str | None = None,
                 *, document: str | None = None, adapter: str | None = None,
                 options: dict[str, Any] | None = None, deadline_ms: int | None = None,
                 job_id: str | None = None) -> dict[str, Any]:
        """A job's body: `texts` (a list, or one string), or else a whole `document`."""
        if (texts is None) == (document is None):
            raise ValueError("give texts or a document, one of the two")
        body: dict[str, Any] = {"v": 1, "id": job_id or uuid.uuid4().hex}
        if document is not None:
            body["document"] = document
        elif isinstance(texts, str):
            body["text"] = texts
        else:
            body["texts"] = list(texts)
        for k, v in (("src_lang", src_lang), ("tgt_lang", tgt_lang), ("adapter", adapter),
                     ("deadline_ms", deadline_ms), ("options", options)):
            if v is not None:
                body[k] = v
        return body


def _json_object(body: bytes) -> dict[str, Any] | None:
    """The body as a JSON object; None when it is not one (not JSON, not UTF-8, or another JSON value)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def _final_reply(body: bytes, data: dict[str, Any] | None) -> OkReply | ErrorReply:
    """A job's final reply, read from its body (`data`: _json_object's); MalformedReply when it is not one."""
    if data is None:
        raise MalformedReply(body, "not a JSON object")
    try:
        reply = reply_of(data)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'reply'}: {err['msg']}" for err in e.errors())
        raise MalformedReply(body, clip(problems)) from None
    assert not isinstance(reply, PartialReply)  # _take_reply hands partials to their callback, never here
    return reply
