"""Prometheus metrics of one worker. Each Metrics owns its registry (several in one test process)."""
from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.options import Translation

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
        self.cancellations = Counter("nllb_job_cancellations", "Jobs answered cancelled, by where the "
                                     "cancel found them: arrived (cancelled before it came), waiting "
                                     "(for rows), running (decoding)", ["stage"], registry=r)
        self.rows_freed_by_cancel = Gauge("nllb_engine_rows_freed_by_cancel", "Engine's cumulative "
                                          "slot-table rows freed by cancellations", registry=r)
        self.engine_cancelled = Gauge("nllb_engine_cancelled_jobs", "Engine's cumulative jobs "
                                      "cancelled before they finished", registry=r)
        # label sets bounded by the NLLB codes (202) and the warning codes (4)
        self.warnings = Counter("nllb_translation_warnings", "Translations (texts or sentences) "
                                "carrying a warning, by warning code and language pair",
                                ["code", "src_lang", "tgt_lang"], registry=r)
        self.retried = Counter("nllb_translation_retried", "Translations re-decoded by on_warning "
                               "retry whose retry was kept", registry=r)
        self.detections = Counter("nllb_language_detections", "Languages identified for src_lang "
                                  "auto (per text; once per document)", ["lang"], registry=r)
        self.detection_unknown = Counter("nllb_language_detection_unknown", "Jobs with src_lang auto "
                                         "answered unknown_language (no confident NLLB language)",
                                         registry=r)
        self.partials = Counter("nllb_partial_messages", "Progress messages (status partial) "
                                "published", registry=r)
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
        # the labelled series each job touches, looked up once (labels() takes a lock and checks its
        # arguments on every call)
        self._outcomes: dict[tuple[str, str], Counter] = {}
        self._warned: dict[tuple[str, str, str], Counter] = {}
        self._detected: dict[str, Counter] = {}
        self._per_adapter: dict[str, tuple[Counter, Counter, Histogram]] = {}

    def translated(self, adapter: str | None, tokens: int, compute_s: float) -> None:
        """A job answered with translations: the totals and the per-adapter series."""
        name = adapter or ""
        series = self._per_adapter.get(name)
        if series is None:
            series = self._per_adapter[name] = (self.adapter_jobs.labels(name), self.adapter_tokens.labels(name),
                                                self.adapter_compute.labels(name))
        self.compute.observe(compute_s)
        self.tokens.inc(tokens)
        jobs, adapter_tokens, adapter_compute = series
        jobs.inc()
        adapter_tokens.inc(tokens)
        adapter_compute.observe(compute_s)

    def text_services(self, src_lang: str, tgt_lang: str, translations: Iterable[Translation],
                      detected: Iterable[str]) -> None:
        """What the engine's text services said of a job: each output's warnings (by the
        language it was translated from), retries kept, languages identified."""
        for t in translations:
            for code in t.warnings:
                key = (code, t.detected_lang or src_lang, tgt_lang)
                series = self._warned.get(key)
                if series is None:  # labels() locks and validates: once a series, not once a warning
                    series = self._warned[key] = self.warnings.labels(*key)
                series.inc()
            if t.retried:
                self.retried.inc()
        for lang in detected:
            series = self._detected.get(lang)
            if series is None:
                series = self._detected[lang] = self.detections.labels(lang)
            series.inc()

    def job_done(self, outcome: str, code: str = "") -> None:
        series = self._outcomes.get((outcome, code))
        if series is None:
            series = self._outcomes[(outcome, code)] = self.jobs.labels(outcome, code)
        series.inc()

    def count(self, outcome: str, code: str = "") -> float:
        return self.jobs.labels(outcome, code)._value.get()

    def render(self) -> bytes:
        return generate_latest(self.registry)
