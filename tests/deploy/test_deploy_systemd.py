"""deploy/systemd: the template unit verifies with systemd-analyze and holds the settings the
worker's lifecycle depends on (notify + watchdog, SIGTERM drain within the stop timeout, one GPU
per instance, hardening that keeps /dev/nvidia* reachable)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from deploy_support import DEPLOY, parse_unit, read_env_file

UNIT = DEPLOY / "systemd" / "nllb-worker@.service"
ENV_EXAMPLE = DEPLOY / "systemd" / "worker.env.example"
EXEC_START = "/opt/nllb-worker/venv/bin/nllb-worker run"


def _service() -> dict[str, list[str]]:
    keys: dict[str, list[str]] = {}
    for key, value in parse_unit(UNIT)["Service"]:
        keys.setdefault(key, []).append(value)
    return keys


def _seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+)\s*(s|sec|min|m)?", value)
    assert match, f"unsupported time span {value!r}"
    return float(match[1]) * (60 if match[2] in ("min", "m") else 1)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    # verify checks that ExecStart's binary exists and is executable. The real path
    # (/opt/nllb-worker/venv/bin/nllb-worker) is not installed here, so the unit is copied into a
    # temp dir with ExecStart pointing at a stub executable inside that dir; nothing else changes.
    stub = tmp_path / "venv" / "bin" / "nllb-worker"
    stub.parent.mkdir(parents=True)
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    text = UNIT.read_text()
    assert text.count(f"ExecStart={EXEC_START}\n") == 1
    unit_dir = tmp_path / "units"
    unit_dir.mkdir()
    (unit_dir / UNIT.name).write_text(text.replace(f"ExecStart={EXEC_START}", f"ExecStart={stub} run"))

    # A template can only be verified through an instance: nllb-worker@0 loads nllb-worker@.service.
    result = subprocess.run(
        ["systemd-analyze", "verify", str(unit_dir / "nllb-worker@0.service")],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    # verify exits 0 on unknown keys and unparsable values ("..., ignoring"): treat any remark about
    # our unit as a failure.
    remarks = [line for line in output.splitlines() if "nllb-worker@" in line or "ignoring" in line]
    assert not remarks, "\n".join(remarks)


def test_unit_lifecycle_settings() -> None:
    svc = _service()
    assert svc["Type"] == ["notify"]
    assert svc["NotifyAccess"] == ["main"]
    assert svc["WatchdogSec"] == ["30"]
    assert svc["Restart"] == ["on-failure"]
    assert svc["KillSignal"] == ["SIGTERM"]
    assert svc["ExecStart"] == [EXEC_START]
    assert "CUDA_VISIBLE_DEVICES=%i" in svc["Environment"]
    assert svc["EnvironmentFile"] == ["/etc/nllb-worker/worker.env", "-/etc/nllb-worker/worker-%i.env"]
    user = svc["User"][0]
    assert user and user != "root"
    # The stop timeout covers the drain budget of the example env file with margin.
    drain = float(read_env_file(ENV_EXAMPLE)["NLLB_DRAIN_TIMEOUT_S"])
    assert _seconds(svc["TimeoutStopSec"][0]) > drain


def test_unit_hardening_keeps_gpu_reachable() -> None:
    svc = _service()
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp"):
        assert svc[key] == ["yes"], key
    assert svc["ProtectSystem"] == ["strict"]
    # PrivateDevices would hide /dev/nvidia*: it must be off, and the NVIDIA nodes allowed.
    assert svc.get("PrivateDevices", ["no"]) == ["no"]
    allowed = " ".join(svc["DeviceAllow"])
    for node in ("/dev/nvidiactl", "/dev/nvidia-uvm", "char-nvidia-frontend"):
        assert node in allowed, node
    # Somewhere writable for the kernel cache under ProtectSystem=strict.
    assert svc.get("CacheDirectory") or svc.get("ReadWritePaths")
    assert "MemoryDenyWriteExecute" not in svc  # CUDA/PyTorch need W+X mappings


def test_env_example_is_a_valid_environment_file() -> None:
    env = read_env_file(ENV_EXAMPLE)
    assert all(key.startswith("NLLB_") for key in env), sorted(env)
    for key in ("NLLB_AMQP_URL", "NLLB_MODEL", "NLLB_METRICS_PORT", "NLLB_DRAIN_TIMEOUT_S"):
        assert key in env, key
    assert env["NLLB_JOBS_QUEUE"] == "nllb.jobs"
    assert env["NLLB_DEAD_LETTER_EXCHANGE"] == "nllb.dlx"
    assert env["NLLB_DEAD_LETTER_QUEUE"] == "nllb.jobs.dead"
    assert env["NLLB_DELIVERY_LIMIT"] == "3"
    assert int(env["NLLB_METRICS_PORT"]) == 9464
