"""Settings the engine could not run are refused when they are read, naming the setting."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from kernels.limits import LORA_MAX_SLOTS
from worker.settings import Settings


def test_more_resident_adapters_than_the_kernels_have_slots_are_refused():
    assert Settings(max_adapters=LORA_MAX_SLOTS - 1).max_adapters == LORA_MAX_SLOTS - 1
    with pytest.raises(ValidationError, match="max_adapters"):
        Settings(max_adapters=LORA_MAX_SLOTS)


def test_a_prefetch_beyond_amqps_short_is_refused():
    assert Settings(prefetch=65535).prefetch == 65535
    with pytest.raises(ValidationError, match="prefetch"):
        Settings(prefetch=70000)


def test_rows_are_bounded_so_that_the_default_prefetch_fits_amqps_short():
    """The default prefetch is twice the rows (one broker process): 32768 rows would ask for 65536."""
    assert 2 * Settings(max_rows=4096).max_rows <= 65535
    for rows in (32768, 100_000_000):
        with pytest.raises(ValidationError, match="max_rows"):
            Settings(max_rows=rows)


def test_cpu_threads_beyond_1024_are_refused():
    assert Settings(cpu_threads=1024).cpu_threads == 1024
    with pytest.raises(ValidationError, match="cpu_threads"):
        Settings(cpu_threads=100_000)


def test_no_float_setting_takes_inf_or_nan():
    floats = [name for name, field in Settings.model_fields.items() if "float" in str(field.annotation)]
    assert "reconnect_interval_s" in floats and "detect_threshold" in floats
    for name in floats:
        for value in ("inf", "nan", "-inf"):
            with pytest.raises(ValidationError, match=name):
                Settings(**{name: value})


@pytest.mark.parametrize("name", ["jobs_queue", "dead_letter_exchange", "dead_letter_queue"])
def test_an_amqp_name_over_255_bytes_is_refused(name):
    assert getattr(Settings(**{name: "q" * 255}), name) == "q" * 255
    with pytest.raises(ValidationError, match=name):
        Settings(**{name: "é" * 128})  # 128 characters, 256 bytes


def test_the_control_exchange_leaves_room_for_its_queues_suffix():
    """Each worker's control queue is named <control_exchange>.<16 hex digits>: 17 bytes more."""
    assert Settings(control_exchange="c" * 238).control_exchange == "c" * 238
    with pytest.raises(ValidationError, match="control_exchange"):
        Settings(control_exchange="c" * 239)


def test_the_last_broker_process_metrics_port_must_be_a_port():
    assert Settings(metrics_port=65534, broker_processes=2).metrics_port == 65534
    assert Settings(metrics_port=0, broker_processes=64).metrics_port == 0  # no HTTP server: no port
    with pytest.raises(ValidationError, match="NLLB_METRICS_PORT"):
        Settings(metrics_port=65534, broker_processes=3)


def test_default_languages_are_nllb_codes_and_auto_is_for_the_source_only():
    s = Settings(default_src_lang="auto", default_tgt_lang="fra_Latn")
    assert (s.default_src_lang, s.default_tgt_lang) == ("auto", "fra_Latn")
    with pytest.raises(ValidationError, match="did you mean 'fra_Latn'"):
        Settings(default_src_lang="fra_latn")
    with pytest.raises(ValidationError, match="default_tgt_lang"):
        Settings(default_tgt_lang="xx_Latn")
    with pytest.raises(ValidationError, match="source language only"):
        Settings(default_tgt_lang="auto")


@pytest.mark.parametrize("url", ["amqp://guest:s3cret@127.0.0.1:99999/", "amqp://guest:s3cret@127.0.0.1:0/",
                                 "http://guest:s3cret@127.0.0.1:5672/", "amqp://guest:s3cret@/", "not a url",
                                 "amqp://guest:s3cret@[::1/"])
def test_an_amqp_url_no_broker_could_have_is_refused(url):
    with pytest.raises(ValidationError, match="amqp_url"):
        Settings(amqp_url=url)
