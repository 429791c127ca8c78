"""Helpers shared by the deploy/ tests. Imported by path-insertion (works under any
pytest import mode): ``sys.path.insert(0, str(Path(__file__).parent)); import deploy_support``."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"

# What the worker declares on the jobs queue (worker/amqp.py must match these exactly).
JOBS_QUEUE_ARGUMENTS = {
    "x-queue-type": "quorum",
    "x-dead-letter-exchange": "nllb.dlx",
    "x-delivery-limit": 3,
    "x-dead-letter-strategy": "at-least-once",
    "x-overflow": "reject-publish",
}
# What the worker declares on the dead-letter queue, and the dead-letter exchange's type.
DEAD_LETTER_QUEUE_ARGUMENTS = {"x-queue-type": "quorum"}
DEAD_LETTER_EXCHANGE_TYPE = "direct"

# The broker the rabbitmq-marked tests use (the local one by default).
AMQP_URL = os.environ.get("NLLB_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")


def broker_reachable(url: str = AMQP_URL, timeout: float = 2.0) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 5672), timeout):
            return True
    except OSError:
        return False


def read_env_file(path: Path) -> dict[str, str]:
    """Parse a systemd EnvironmentFile (KEY=VALUE lines, # comments, optional quotes)."""
    env: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path}: not KEY=VALUE: {raw!r}"
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key.strip()] = value
    return env


def parse_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """A systemd unit as {section: [(key, value), ...]} (keys repeat, order kept)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
            sections.setdefault(current, [])
            continue
        key, _, value = line.partition("=")
        assert current is not None, f"{path}: key outside a section: {raw!r}"
        sections[current].append((key.strip(), value.strip()))
    return sections
