"""deploy/: the compose file, the Kubernetes manifests, the Dockerfile and the broker definitions
parse and carry what running the worker depends on (GPU reservation, health checks, stop grace
above the drain budget, KEDA on the jobs queue, a PDB, topology = what the worker declares)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from deploy_support import (
    DEAD_LETTER_EXCHANGE_TYPE,
    DEAD_LETTER_QUEUE_ARGUMENTS,
    DEPLOY,
    JOBS_QUEUE_ARGUMENTS,
)

K8S = DEPLOY / "k8s"


def _duration_s(value: str | int) -> float:
    """A compose duration ('90s', '1m30s', 90) in seconds."""
    if isinstance(value, (int, float)):
        return float(value)
    total, units = 0.0, {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", value)
    assert parts and "".join(n + u for n, u in parts) == value, f"bad duration {value!r}"
    for number, unit in parts:
        total += float(number) * units[unit]
    return total


# ----------------------------------------------------------------------------- compose


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def test_compose_broker_loads_definitions_and_is_health_checked(compose: dict) -> None:
    rabbit = compose["services"]["rabbitmq"]
    assert rabbit["image"].startswith("rabbitmq:4") and "management" in rabbit["image"]
    mounts = {m.split(":")[1]: m.split(":")[0] for m in rabbit["volumes"] if m.startswith("./")}
    conf_target = next(t for t, s in mounts.items() if s == "./rabbitmq/rabbitmq.conf")
    assert conf_target.startswith("/etc/rabbitmq/")
    conf = (DEPLOY / "rabbitmq" / "rabbitmq.conf").read_text()
    load = re.search(r"^load_definitions\s*=\s*(\S+)", conf, re.MULTILINE)
    assert load, "rabbitmq.conf must set load_definitions"
    # Every mounted definitions file lands where load_definitions points (a directory of *.json).
    defs = {s: t for t, s in mounts.items() if s.endswith(".json")}
    assert "./rabbitmq/definitions.json" in defs
    for source, target in defs.items():
        assert (DEPLOY / source).is_file(), source
        assert target.startswith(load[1].rstrip("/") + "/") and target.endswith(".json"), target
    assert rabbit["healthcheck"]["test"]


def test_compose_gpu_worker(compose: dict) -> None:
    worker = compose["services"]["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    # Scalable with --scale worker=N: no fixed name, no host port.
    assert "container_name" not in worker
    assert "ports" not in worker
    assert worker["depends_on"]["rabbitmq"]["condition"] == "service_healthy"
    assert worker["healthcheck"]["test"]
    assert "/healthz" in " ".join(worker["healthcheck"]["test"])
    env = worker["environment"]
    assert env["NLLB_DEVICE"] == "cuda" and env["NLLB_MODEL"] == "/models"
    assert env["NLLB_ADAPTERS_DIR"] == "/adapters"
    assert worker.get("stop_signal", "SIGTERM") == "SIGTERM"
    assert _duration_s(worker["stop_grace_period"]) > float(env["NLLB_DRAIN_TIMEOUT_S"])
    assert worker["build"]["target"] == "gpu"


def test_compose_cpu_profile_runs_the_toy_model(compose: dict) -> None:
    cpu = compose["services"]["worker-cpu"]
    assert cpu["profiles"] == ["cpu"]
    assert cpu["build"]["target"] == "cpu"
    env = cpu["environment"]
    assert env["NLLB_DEVICE"] == "cpu"
    assert "NLLB_MODEL" not in env  # unset = the bundled toy model
    assert "deploy" not in cpu  # no GPU reservation
    assert "container_name" not in cpu and "ports" not in cpu
    assert _duration_s(cpu["stop_grace_period"]) > float(env["NLLB_DRAIN_TIMEOUT_S"])


@pytest.mark.skipif(shutil.which("docker") is None, reason="docker CLI not installed")
def test_compose_config_validates_with_docker_compose() -> None:
    probe = subprocess.run(["docker", "compose", "version"], check=False, capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip("docker compose plugin not installed")
    result = subprocess.run(
        ["docker", "compose", "-f", str(DEPLOY / "compose.yaml"), "--profile", "cpu", "config", "-q"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


# ----------------------------------------------------------------------------- Dockerfile


def _dockerfile_stages() -> dict[str, list[str]]:
    """Instructions of each stage (continuation lines joined), by stage name."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    stages: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"FROM\s+(\S+)\s+AS\s+(\S+)", line, re.IGNORECASE)
        if match:
            current = match[2]
            stages[current] = [line]
        elif current:
            stages[current].append(line)
    return stages


def test_dockerfile_targets() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    stages = _dockerfile_stages()
    assert set(stages) >= {"gpu", "cpu"}
    assert list(stages)[-1] == "gpu", "the GPU image is the default (last) stage"
    assert re.search(r"ARG CUDA_IMAGE=nvidia/cuda:13[\d.]*-runtime-ubuntu", text)
    assert re.search(r"ARG PYTHON_IMAGE=python:3[\d.]*-slim", text)
    gpu, cpu = "\n".join(stages["gpu"]), "\n".join(stages["cpu"])
    assert 'pip install --extra-index-url "$TORCH_GPU_INDEX" ".[gpu]"' in gpu
    assert "whl/cpu" in text and 'pip install --index-url "$TORCH_CPU_INDEX" torch' in cpu
    for name, stage in (("gpu", gpu), ("cpu", cpu)):
        assert re.search(r"^USER nllb", stage, re.MULTILINE), name
        assert re.search(r"^STOPSIGNAL SIGTERM$", stage, re.MULTILINE), name
        assert re.search(r'^CMD \["nllb-worker", "run"\]$', stage, re.MULTILINE), name
        assert "HEALTHCHECK" in stage and "/healthz" in stage and "urllib" in stage, name
        assert "NLLB_METRICS_PORT', '9464'" in stage, name
        assert "EXPOSE 9464" in stage, name
    assert "NLLB_MODEL=/models" in gpu and "NLLB_ADAPTERS_DIR=/adapters" in gpu
    assert 'VOLUME ["/models", "/adapters"]' in gpu
    assert "NLLB_MODEL" not in cpu  # toy model
    assert (DEPLOY / "Dockerfile.dockerignore").read_text().count(".venv")


# ----------------------------------------------------------------------------- Kubernetes


@pytest.fixture(scope="module")
def k8s() -> dict[str, dict]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    docs: dict[str, dict] = {}
    for resource in kustomization["resources"]:
        for doc in yaml.safe_load_all((K8S / resource).read_text()):
            if doc:
                docs[doc["kind"]] = doc
    return docs


def test_kustomization_ties_every_manifest(k8s: dict[str, dict]) -> None:
    assert set(k8s) == {
        "ConfigMap",
        "Secret",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "TriggerAuthentication",
        "ScaledObject",
    }
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk


def test_k8s_deployment(k8s: dict[str, dict]) -> None:
    deployment = k8s["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == 9464
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    config = k8s["ConfigMap"]["data"]
    assert int(config["NLLB_METRICS_PORT"]) == 9464
    assert pod["terminationGracePeriodSeconds"] > float(config["NLLB_DRAIN_TIMEOUT_S"])
    assert "preStop" not in container.get("lifecycle", {})
    sources = {next(iter(s)): next(iter(s.values()))["name"] for s in container["envFrom"]}
    assert sources == {
        "configMapRef": k8s["ConfigMap"]["metadata"]["name"],
        "secretRef": k8s["Secret"]["metadata"]["name"],
    }
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/models"]["readOnly"] and mounts["/adapters"]["readOnly"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    labels = deployment["spec"]["selector"]["matchLabels"]
    assert labels.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def test_k8s_settings_split_secret_from_config(k8s: dict[str, dict]) -> None:
    secret = k8s["Secret"]["stringData"]
    config = k8s["ConfigMap"]["data"]
    assert set(secret) == {"NLLB_AMQP_URL"}
    assert "NLLB_AMQP_URL" not in config
    assert config["NLLB_JOBS_QUEUE"] == "nllb.jobs"
    assert config["NLLB_DEVICE"] == "cuda" and config["NLLB_MODEL"] == "/models"
    assert all(isinstance(v, str) for v in config.values()), "ConfigMap values must be strings"


def test_k8s_keda_scales_on_jobs_queue_depth(k8s: dict[str, dict]) -> None:
    scaled = k8s["ScaledObject"]["spec"]
    assert scaled["scaleTargetRef"]["name"] == k8s["Deployment"]["metadata"]["name"]
    (trigger,) = scaled["triggers"]
    assert trigger["type"] == "rabbitmq"
    assert trigger["metadata"]["mode"] == "QueueLength"
    assert trigger["metadata"]["queueName"] == k8s["ConfigMap"]["data"]["NLLB_JOBS_QUEUE"]
    assert int(trigger["metadata"]["value"]) > 0
    auth = k8s["TriggerAuthentication"]
    assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
    (ref,) = auth["spec"]["secretTargetRef"]
    assert ref == {"parameter": "host", "name": k8s["Secret"]["metadata"]["name"], "key": "NLLB_AMQP_URL"}
    assert 1 <= scaled["minReplicaCount"] <= scaled["maxReplicaCount"]


def test_k8s_pdb_and_metrics_service(k8s: dict[str, dict]) -> None:
    pod_labels = k8s["Deployment"]["spec"]["template"]["metadata"]["labels"]
    pdb = k8s["PodDisruptionBudget"]["spec"]
    assert pdb["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pdb.get("maxUnavailable") == 1 or pdb.get("minAvailable") is not None
    service = k8s["Service"]["spec"]
    assert service["selector"].items() <= pod_labels.items()
    (port,) = service["ports"]
    assert port["port"] == 9464 and port["targetPort"] == "metrics"


def test_k8s_core_manifests_match_the_kubernetes_schema(k8s: dict[str, dict]) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for doc in k8s.values():
        if doc["apiVersion"].startswith("keda.sh/"):
            continue  # CRDs: no bundled schema
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kustomize_builds() -> None:
    result = subprocess.run(["kubectl", "kustomize", str(K8S)], check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    kinds = [doc["kind"] for doc in yaml.safe_load_all(result.stdout) if doc]
    assert len(kinds) == 7
    deployment = next(d for d in yaml.safe_load_all(result.stdout) if d and d["kind"] == "Deployment")
    assert deployment["metadata"]["labels"]["app.kubernetes.io/part-of"] == "nllb"


# ----------------------------------------------------------------------------- broker definitions


@pytest.fixture(scope="module")
def definitions() -> dict:
    return json.loads((DEPLOY / "rabbitmq" / "definitions.json").read_text())


def test_definitions_topology(definitions: dict) -> None:
    queues = {q["name"]: q for q in definitions["queues"]}
    jobs, dead = queues["nllb.jobs"], queues["nllb.jobs.dead"]
    assert jobs["durable"] and not jobs["auto_delete"] and jobs["vhost"] == "/"
    assert jobs["arguments"] == JOBS_QUEUE_ARGUMENTS
    assert dead["durable"] and dead["arguments"] == DEAD_LETTER_QUEUE_ARGUMENTS
    (dlx,) = [e for e in definitions["exchanges"] if e["name"] == "nllb.dlx"]
    assert dlx["type"] == DEAD_LETTER_EXCHANGE_TYPE and dlx["durable"]
    assert {
        (b["source"], b["destination"], b["destination_type"], b["routing_key"]) for b in definitions["bindings"]
    } == {("nllb.dlx", "nllb.jobs.dead", "queue", "nllb.jobs")}


def test_definitions_limits_live_in_policies(definitions: dict) -> None:
    # Anything the worker does not declare must be a policy, or the declaration conflicts.
    for queue in definitions["queues"]:
        assert not {"x-max-length", "x-max-length-bytes", "x-message-ttl"} & set(queue["arguments"])
    policies = {p["name"]: p for p in definitions["policies"]}
    for name in ("nllb.jobs", "nllb.jobs.dead"):
        (policy,) = [p for p in policies.values() if re.fullmatch(p["pattern"], name)]
        assert policy["apply-to"] == "queues"
        assert policy["definition"]["max-length"] > 0
        assert policy["definition"]["overflow"] == "reject-publish"
    # The jobs policy must not also match the DLQ (one policy applies per queue).
    (jobs_policy,) = [p for p in policies.values() if re.fullmatch(p["pattern"], "nllb.jobs")]
    assert not re.fullmatch(jobs_policy["pattern"], "nllb.jobs.dead")


def test_dev_users_file_is_development_only() -> None:
    users = json.loads((DEPLOY / "rabbitmq" / "dev-users.json").read_text())
    assert [u["name"] for u in users["users"]] == ["nllb"]
    assert "users" not in json.loads((DEPLOY / "rabbitmq" / "definitions.json").read_text())


def test_load_script_refuses_a_missing_file(tmp_path: Path) -> None:
    result = subprocess.run(
        ["bash", str(DEPLOY / "rabbitmq" / "load-definitions.sh"), str(tmp_path / "nope.json")],
        check=False,
        capture_output=True,
        text=True,
        env={**os.environ, "LOAD_WITH": "rabbitmqctl"},
        timeout=30,
    )
    assert result.returncode == 2 and "cannot read" in result.stderr
