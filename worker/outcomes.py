"""Every ack/nack/reject decision in one place: what a delivery's outcome tells the broker.

| outcome       | when                                                       | action                |
|---------------|------------------------------------------------------------|-----------------------|
| ok            | translated; reply confirmed                                | ack                   |
| error         | deterministic error (bad JSON/schema/options, unknown      | ack                   |
|               | language/adapter, too long, deadline, cancelled,           |                       |
|               | overloaded, internal); error reply confirmed               |                       |
| dead_letter   | unanswerable: no reply_to (parseable or not)               | reject → DLQ          |
| requeue       | a failed attempt: engine failure, a worker bug             | reject with requeue   |
|               |                                                            | (counted)             |
| released      | the job not at fault: its reply not confirmed before       | nack with requeue     |
|               | shutdown                                                   |                       |
| handed_back   | unfinished when the drain's time ran out, or delivered     | republish, ack        |
|               | while stopping: a copy goes to the back of the queue       |                       |
|               | (confirmed), so a drain never counts as a failed delivery  |                       |
| undeliverable | the reply could not be delivered: unroutable (its queue is | reject → DLQ          |
|               | gone) or refused (nacked for reply_refused_after_s)        |                       |

`amqp.settle` sends each action (what the broker counts toward the delivery limit is in its doc). A
delivery whose channel died meanwhile cannot be settled (stale tag; the broker requeued it): it is
counted as `stale`, never acked twice, and answered again when redelivered.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Outcome(enum.Enum):
    OK = "ok"
    ERROR = "error"
    DEAD_LETTER = "dead_letter"
    REQUEUE = "requeue"
    RELEASED = "released"
    HANDED_BACK = "handed_back"
    UNDELIVERABLE = "undeliverable"


#: THE decision table: outcome of a delivery → what the broker is told.
ACTIONS: dict[Outcome, str] = {
    Outcome.OK: "ack",
    Outcome.ERROR: "ack",
    Outcome.DEAD_LETTER: "reject",
    Outcome.REQUEUE: "retry",
    Outcome.RELEASED: "release",
    Outcome.HANDED_BACK: "republish",
    Outcome.UNDELIVERABLE: "reject",
}


def decide(outcome: Outcome) -> str:
    return ACTIONS[outcome]


@dataclass
class Result:
    outcome: Outcome
    code: str = ""          # error code for ERROR, reason for the others
    details: dict[str, object] | None = None  # for the "job settled" line: tokens and compute of a translation


class Requeue(Exception):
    """Give the job back to the queue. `reason` is a short label (metrics), `detail` is logged."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


#: a Requeue's reason → its outcome: only a failure of the job's own attempt counts toward the delivery limit
REQUEUE_OUTCOMES: dict[str, Outcome] = {
    "engine_failure": Outcome.REQUEUE,
    "shutdown": Outcome.HANDED_BACK,
    "reply_not_confirmed": Outcome.RELEASED,
}
