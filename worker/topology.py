"""The broker's topology of PROTOCOL.md: what the worker declares, how a broker that holds it otherwise or refuses
this worker is told to the operator, and the check that keeps it in place while the worker runs.

Declared at start, exactly (another file, deploy/rabbitmq/definitions.json, must match it; a mismatch fails
loudly with PRECONDITION_FAILED instead of silently running with other guarantees):

- exchange `<dead_letter_exchange>`: direct, durable;
- queue `<dead_letter_queue>`: durable quorum, no other arguments, bound to the exchange with
  routing key `<jobs_queue>`;
- queue `<jobs_queue>`: durable, arguments `jobs_queue_arguments(settings)`;
- exchange `<control_exchange>`: fanout, durable (cancels), and bound to it a queue of this
  worker's own: exclusive, auto-delete, named `<control_exchange>.<random>` by the worker (not by
  the server) so that the robust connection declares and binds the same queue again after a
  reconnection, and its consumer with it.

While the worker runs, someone may delete or re-declare these (an operator, a definitions import).
`check_topology` declares them again on a channel of its own, which puts back what is gone (a dead-letter
queue deleted would otherwise drop every dead letter) and finds what was declared otherwise (a jobs queue made
anew as a classic queue has no dead-letter exchange and no delivery limit) without closing the consuming
channel: `amqp.Broker` runs it before consuming again and every TOPOLOGY_CHECK_S, and consumes only while it
holds.
"""
from __future__ import annotations

import contextlib
import re
from typing import Any

import aio_pika
import aiormq

from worker.settings import Settings

TOPOLOGY_CHECK_S = 30.0  # how often a running worker declares its topology again
#: what a worker that waits for its jobs queue to match again logs, once a mismatch
WAITING_FOR_MATCH = ("the broker's queues were declared anew otherwise: not consuming jobs until they match this "
                     "worker's settings again")


def jobs_queue_arguments(settings: Settings) -> dict[str, Any]:
    return {
        "x-queue-type": "quorum",
        "x-dead-letter-exchange": settings.dead_letter_exchange,
        "x-delivery-limit": settings.delivery_limit,
        "x-dead-letter-strategy": "at-least-once",
        "x-overflow": "reject-publish",
    }


async def declare_topology(channel: aio_pika.abc.AbstractChannel, settings: Settings
                           ) -> aio_pika.abc.AbstractQueue:
    """Declare the DLX, the DLQ and its binding, and the jobs queue; return the jobs queue."""
    dlx = await channel.declare_exchange(settings.dead_letter_exchange,
                                         aio_pika.ExchangeType.DIRECT, durable=True)
    dlq = await channel.declare_queue(settings.dead_letter_queue, durable=True,
                                      arguments={"x-queue-type": "quorum"})
    await dlq.bind(dlx, routing_key=settings.jobs_queue)
    return await channel.declare_queue(settings.jobs_queue, durable=True,
                                       arguments=jobs_queue_arguments(settings))


class TopologyMismatch(Exception):
    """The broker holds a queue or exchange of ours declared with other arguments: a
    configuration error, not an outage (retrying cannot help)."""


#: RabbitMQ's PRECONDITION_FAILED text for a declaration that differs from what exists
_INEQUIVALENT = re.compile(
    r"inequivalent arg '(?P<arg>[^']*)' for (?P<kind>queue|exchange) '(?P<name>[^']*)'.*?: "
    r"received (?:none|(?:the value )?'(?P<ours>[^']*)'.*?) but current is "
    r"(?:none|(?:the value )?'(?P<theirs>[^']*)')")
_SETTING_OF_ARG = {"x-delivery-limit": "NLLB_DELIVERY_LIMIT",
                   "x-dead-letter-exchange": "NLLB_DEAD_LETTER_EXCHANGE"}


def describe_refusal(e: BaseException) -> str | None:
    """One line for the operator when the broker refuses this worker in a way that retrying cannot mend (its
    credentials, its permissions), with the fix; None for any other error."""
    if isinstance(e, (aiormq.exceptions.ProbableAuthenticationError, aiormq.exceptions.AuthenticationError)):
        return ("the broker refused the user name or password of NLLB_AMQP_URL: set the user's password there, "
                "or create the user on the broker")
    if isinstance(e, aiormq.exceptions.ChannelAccessRefused):
        return (f"the broker refused access to this worker's queues or exchanges ({e}): give the user configure, "
                f"write and read permissions on them (rabbitmqctl set_permissions), or name them otherwise "
                f"(NLLB_JOBS_QUEUE and the others; names starting amq. are the broker's)")
    return None


def connection_hint(e: BaseException) -> str | None:
    """What a failed first connection may mean where the error does not say: the broker closing the connection
    as it is opened comes without its reason (aiormq keeps only the frame's name). Such a close may pass (the
    vhost's connection limit reached, the vhost starting), so it is retried, not a refusal."""
    if isinstance(e, (aiormq.exceptions.InvalidFrameError, aiormq.exceptions.ConnectionNotAllowed)):
        return ("the broker closed the connection as it was opened: the vhost of NLLB_AMQP_URL does not exist, "
                "its user may not open it (rabbitmqctl add_vhost / set_permissions), or its connection limit "
                "is reached")
    return None


def describe_mismatch(reply_text: str) -> str:
    """One line for the operator: which queue, which argument, the broker's value and ours, and
    how to fix it."""
    m = _INEQUIVALENT.search(reply_text)
    if m is None:
        return (f"the broker refused a declaration of this worker's topology ({reply_text}); "
                f"make the NLLB_* settings match the existing queues, or delete those queues")
    kind, name, arg = m["kind"], m["name"], m["arg"]
    theirs, ours = m["theirs"] or "unset", m["ours"] or "unset"
    setting = _SETTING_OF_ARG.get(arg)
    fix = f"set {setting}={theirs}" if setting and m["theirs"] else "change this worker's settings"
    return (f"{kind} '{name}' exists with {arg}={theirs} but this worker declares {arg}={ours}: "
            f"{fix} to match it, or delete the {kind} (rabbitmqctl delete_{kind} {name}) so that "
            f"it is declared anew")


async def check_topology(connection: aio_pika.abc.AbstractRobustConnection, settings: Settings,
                         control_queue: str | None) -> None:
    """Declare the topology again on a channel of its own, and bind `control_queue` to the control exchange:
    what was deleted is made anew; TopologyMismatch when something was declared otherwise meanwhile."""
    channel = await connection.channel()
    try:
        await declare_topology(channel, settings)
        exchange = await channel.declare_exchange(settings.control_exchange, aio_pika.ExchangeType.FANOUT,
                                                  durable=True)
        if control_queue is not None:
            queue = await channel.get_queue(control_queue, ensure=False)
            await queue.bind(exchange)
    except aiormq.exceptions.ChannelPreconditionFailed as e:
        raise TopologyMismatch(describe_mismatch(str(e))) from None
    finally:
        with contextlib.suppress(Exception):
            await channel.close()
