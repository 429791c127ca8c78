"""Prometheus metrics of one worker. Each Metrics owns its registry (several in one test process).

The series every job touches (jobs by outcome, tokens, compute time, and those per adapter) are plain numbers
kept by `JobSeries` and read into metric families when scraped: as prometheus_client series they took a lock
and two checks at every update, ~10 updates a job, ~5% of the event loop's time a job on the 2-core machine.
Their exposition is what the same prometheus_client Counter and Histogram write, less the histograms'
`_created` samples.
"""
from __future__ import annotations

import bisect
import time
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from engine.options import Translation

OUTCOMES = ("ok", "error", "dead_letter", "requeue", "released", "handed_back", "undeliverable", "stale")

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.job_series = JobSeries()  # jobs by outcome, tokens, compute time, and those per adapter
        r.register(self.job_series)
        self.in_flight = Gauge("nllb_jobs_in_flight", "Job messages held (received, not yet "
                               "acked/nacked)", registry=r)
        self.rows_used = Gauge("nllb_engine_rows_used", "Slot-table rows in use", registry=r)
        self.rows_total = Gauge("nllb_engine_rows_total", "Slot-table rows (capacity)", registry=r)
        self.jobs_waiting = Gauge("nllb_engine_jobs_waiting", "Jobs waiting for rows", registry=r)
        self.queue_wait = Histogram("nllb_job_queue_wait_seconds", "Broker wait: publish "
                                    "timestamp to receipt (jobs with a timestamp property)",
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
        # the labelled series of text services, looked up once (labels() takes a lock and checks its arguments)
        self._warned: dict[tuple[str, str, str], Counter] = {}
        self._detected: dict[str, Counter] = {}

    def translated(self, adapter: str | None, tokens: int, compute_s: float) -> None:
        """A job answered with translations: the totals and the per-adapter series."""
        self.job_series.translated(adapter or "", tokens, compute_s)

    def text_services(self, src_lang: str, tgt_lang: str, translations: Iterable[Translation],
                      detected: Iterable[str]) -> None:
        """What the engine's text services said of a job: each output's warnings (by the
        language it was translated from), retries kept, languages identified."""
        for t in translations:
            for code in t.warnings:
                key = (code, t.detected_lang or src_lang, tgt_lang)
                series = self._warned.get(key)
                if series is None:
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
        self.job_series.done(outcome, code)

    def count(self, outcome: str, code: str = "") -> float:
        return self.job_series.jobs.get((outcome, code), 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Histogram:
    """One histogram series as plain numbers: the count in each bucket (not cumulative, +Inf last) and the sum."""

    def __init__(self) -> None:
        self.counts = [0] * (len(_LAT) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(_LAT, value)] += 1  # the first bound >= value, as prometheus_client's
        self.sum += value

    def buckets(self) -> list[tuple[str, float]]:
        counts, total = list(self.counts), 0
        out = []
        for bound, count in zip([*_LAT, float("inf")], counts):
            total += count
            out.append((floatToGoString(bound), float(total)))
        return out


class JobSeries:
    """The series every job touches, as plain numbers updated by the event loop (no lock: one thread writes them,
    and a scrape copies each under the GIL), exposed as prometheus_client would expose the same Counter and
    Histogram series (see the module doc)."""

    def __init__(self) -> None:
        self.jobs: dict[tuple[str, str], float] = {}  # (outcome, code) -> jobs
        self.tokens = 0.0
        self.compute = _Histogram()
        # adapter ('' = base model) -> jobs, tokens, compute; the names are bounded by the adapters directory (the
        # engine refuses others before a job is translated)
        self.adapter_jobs: dict[str, float] = {}
        self.adapter_tokens: dict[str, float] = {}
        self.adapter_compute: dict[str, _Histogram] = {}
        # when each counter series was first counted
        self._tokens_created = time.time()
        self._jobs_created: dict[tuple[str, str], float] = {}
        self._adapter_created: dict[str, float] = {}

    def done(self, outcome: str, code: str) -> None:
        key = (outcome, code)
        if key not in self.jobs:
            self._jobs_created[key] = time.time()
            self.jobs[key] = 0.0
        self.jobs[key] += 1

    def translated(self, adapter: str, tokens: int, compute_s: float) -> None:
        self.tokens += tokens
        self.compute.observe(compute_s)
        if adapter not in self.adapter_jobs:
            self._adapter_created[adapter] = time.time()
            self.adapter_jobs[adapter] = self.adapter_tokens[adapter] = 0.0
            self.adapter_compute[adapter] = _Histogram()
        self.adapter_jobs[adapter] += 1
        self.adapter_tokens[adapter] += tokens
        self.adapter_compute[adapter].observe(compute_s)

    def describe(self) -> list[Metric]:
        return list(self.collect())

    def collect(self) -> Iterator[Metric]:
        jobs_created, adapter_created = dict(self._jobs_created), dict(self._adapter_created)
        jobs = CounterMetricFamily("nllb_jobs", "Jobs finished, by outcome (ok, error, dead_letter, requeue, "
                                   "handed_back, undeliverable, stale) and error code", labels=["outcome", "code"])
        for (outcome, code), value in dict(self.jobs).items():
            jobs.add_metric([outcome, code], value, created=jobs_created.get((outcome, code)))
        yield jobs
        compute = HistogramMetricFamily("nllb_job_compute_seconds", "Engine work per job: from taking slot-table "
                                        "rows to the result", labels=[])
        compute.add_metric([], self.compute.buckets(), self.compute.sum)
        yield compute
        tokens = CounterMetricFamily("nllb_generated_tokens", "Target tokens generated (replies)", labels=[])
        tokens.add_metric([], self.tokens, created=self._tokens_created)
        yield tokens
        per_jobs = CounterMetricFamily("nllb_adapter_jobs", "Jobs translated, per LoRA adapter ('' = base model)",
                                       labels=["adapter"])
        per_tokens = CounterMetricFamily("nllb_adapter_generated_tokens", "Target tokens generated, per LoRA "
                                         "adapter ('' = base model)", labels=["adapter"])
        per_compute = HistogramMetricFamily("nllb_adapter_compute_seconds", "Engine work per job, per LoRA "
                                            "adapter ('' = base model)", labels=["adapter"])
        for adapter, histogram in dict(self.adapter_compute).items():
            per_jobs.add_metric([adapter], self.adapter_jobs[adapter], created=adapter_created.get(adapter))
            per_tokens.add_metric([adapter], self.adapter_tokens[adapter], created=adapter_created.get(adapter))
            per_compute.add_metric([adapter], histogram.buckets(), histogram.sum)
        yield from (per_jobs, per_tokens, per_compute)
