"""pytest wiring for the deploy/ tests: markers and the broker fixture."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import deploy_support


def pytest_configure(config: pytest.Config) -> None:
    # pyproject.toml registers these too; registering here keeps --strict-markers happy either way.
    for line in (
        "rabbitmq: needs a RabbitMQ broker (NLLB_TEST_AMQP_URL, default 127.0.0.1:5672 guest/guest)",
        "slow: takes more than a few seconds",
        "gpu: needs a CUDA GPU",
    ):
        config.addinivalue_line("markers", line)


@pytest.fixture
def amqp_url() -> str:
    """The test broker's URL; skips when nothing answers there (fails instead under CI)."""
    url = deploy_support.AMQP_URL
    if not deploy_support.broker_reachable(url):
        message = f"no RabbitMQ answering at {urlsplit(url).netloc.split('@')[-1]}"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI: .ci/run must start one)")
        pytest.skip(message)
    return url
