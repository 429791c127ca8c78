"""Prometheus metrics of one worker. Each Metrics owns its registry (several in one test process)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

OUTCOMES = ("ok", "error", "dead_letter", "requeue", "handed_back", "reply_returned", "stale")

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.jobs = Counter("nllb_jobs", "Jobs finished, by outcome (ok, error, dead_letter, "
                            "requeue, handed_back, reply_returned, stale) and error code", ["outcome", "code"],
                            registry=r)
        self.in_flight = Gauge("nllb_jobs_in_flight", "Job messages held (received, not yet "
                               "acked/nacked)", registry=r)
        self.rows_used = Gauge("nllb_engine_rows_used", "Slot-table rows in use", registry=r)
        self.rows_total = Gauge("nllb_engine_rows_total", "Slot-table rows (capacity)", registry=r)
        self.jobs_waiting = Gauge("nllb_engine_jobs_waiting", "Jobs waiting for rows", registry=r)
        self.queue_wait = Histogram("nllb_job_queue_wait_seconds", "Broker wait: publish "
                                    "timestamp to receipt (jobs with a timestamp property)",
                                    buckets=_LAT, registry=r)
        self.compute = Histogram("nllb_job_compute_seconds", "Engine work per job: from taking "
                                 "slot-table rows to the result", buckets=_LAT, registry=r)
        self.tokens = Counter("nllb_generated_tokens", "Target tokens generated (replies)",
                              registry=r)
        # per adapter ('' = base model); the label set is bounded by the adapters directory
        self.adapter_jobs = Counter("nllb_adapter_jobs", "Jobs translated, per LoRA adapter "
                                    "('' = base model)", ["adapter"], registry=r)
        self.adapter_tokens = Counter("nllb_adapter_generated_tokens", "Target tokens generated, per "
                                      "LoRA adapter ('' = base model)", ["adapter"], registry=r)
        self.adapter_compute = Histogram("nllb_adapter_compute_seconds", "Engine work per job, per "
                                         "LoRA adapter ('' = base model)", ["adapter"],
                                         buckets=_LAT, registry=r)
        self.engine_tokens = Gauge("nllb_engine_tokens_generated", "Engine's cumulative "
                                   "generated tokens (rate() = tokens/s)", registry=r)
        self.reconnects = Counter("nllb_amqp_reconnects", "Broker reconnections", registry=r)
        self.stale_acks = Counter("nllb_stale_acks", "Acks/nacks impossible because the delivery's "
                                  "channel died (the broker requeued the job)", registry=r)
        self.publish_retries = Counter("nllb_reply_publish_retries", "Reply publishes retried "
                                       "after a connection problem", registry=r)
        self.loop_lag = Histogram("nllb_event_loop_lag_seconds", "Event-loop lag (timer overshoot)",
                                  buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5),
                                  registry=r)
        self.loop_lag_max = Gauge("nllb_event_loop_lag_max_seconds", "Largest loop lag in the last "
                                  "10 s", registry=r)
        self.ready = Gauge("nllb_ready", "1 when connected, consuming and the engine is up",
                           registry=r)

    def translated(self, adapter: str | None, tokens: int, compute_s: float) -> None:
        """A job answered with translations: the totals and the per-adapter series."""
        name = adapter or ""
        self.compute.observe(compute_s)
        self.tokens.inc(tokens)
        self.adapter_jobs.labels(name).inc()
        self.adapter_tokens.labels(name).inc(tokens)
        self.adapter_compute.labels(name).observe(compute_s)

    def job_done(self, outcome: str, code: str = "") -> None:
        self.jobs.labels(outcome, code).inc()

    def count(self, outcome: str, code: str = "") -> float:
        return self.jobs.labels(outcome, code)._value.get()

    def render(self) -> bytes:
        return generate_latest(self.registry)
