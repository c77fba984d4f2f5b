"""deploy/kubernetes renders with kustomize, validates against a current Kubernetes release, keeps
the sidecar pattern, and its Prometheus Operator objects carry their required fields; the agent
image's Dockerfile copies files that exist and its pip install works in a clean venv without torch.

kubectl comes from the machine (Debian's kubernetes-client or Google's kubectl package; .ci/run
installs one); kubernetes-validate from the `test` extra.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from alerts import build as rules  # noqa: E402
from dashboards import build as dashboards  # noqa: E402

KUSTOMIZE_DIR = os.path.join(ROOT, "deploy", "kubernetes")
DOCKERFILE = os.path.join(ROOT, "deploy", "docker", "Dockerfile")
# The newest Kubernetes release whose schemas kubernetes-validate ships (1.37.0 in 1.37.0).
KUBERNETES_VERSION = "1.37.0"
# Required fields of the Prometheus Operator CRDs (monitoring.coreos.com/v1), read from
# prometheus-operator example/prometheus-operator-crd/*.yaml at 6adcebc (2026-08-08).
CRD_REQUIRED = {
    "ServiceMonitor": {".": ["spec"], ".spec": ["endpoints", "selector"]},
    "PrometheusRule": {".": ["spec"], ".spec.groups[]": ["name"], ".spec.groups[].rules[]": ["expr"]},
}


def _kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail("kubectl is not installed: apt-get install -y --no-install-recommends kubernetes-client "
                    "(or run `make system-deps`)")
    return path


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    proc = subprocess.run([_kubectl(), "kustomize", KUSTOMIZE_DIR], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def _one(objs: list[dict], kind: str) -> dict:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, (kind, [o["kind"] for o in objs])
    return found[0]


def _is_core(obj: dict) -> bool:
    return not obj["apiVersion"].startswith("monitoring.coreos.com/")


def test_kustomize_renders_every_object_into_the_namespace(rendered):
    assert sorted(o["kind"] for o in rendered) == ["ConfigMap", "Namespace", "PrometheusRule", "Service",
                                                   "ServiceMonitor", "StatefulSet"]
    for o in rendered:
        if o["kind"] != "Namespace":
            assert o["metadata"]["namespace"] == "hisparse", o["kind"]


def test_core_objects_validate_against_kubernetes(rendered):
    import kubernetes_validate

    core = [o for o in rendered if _is_core(o)]
    assert len(core) == 4
    for obj in core:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    # The validator can fail: a misspelled field and a wrong type are refused.
    sts = copy.deepcopy(_one(rendered, "StatefulSet"))
    sts["spec"]["template"]["spec"]["shareProcessNamespaces"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, KUBERNETES_VERSION, strict=True)
    sts = copy.deepcopy(_one(rendered, "StatefulSet"))
    sts["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, KUBERNETES_VERSION, strict=True)


def _missing_required(obj: dict, required: dict[str, list[str]]) -> list[str]:
    out = []
    for path, fields in required.items():
        nodes = [obj]
        for part in [p for p in path.split(".") if p]:
            many = part.endswith("[]")
            key = part[:-2] if many else part
            nxt = []
            for n in nodes:
                value = n.get(key)
                if value is None:
                    continue
                nxt.extend(value if many else [value])
            nodes = nxt
        for n in nodes:
            out += [f"{path}.{f}" for f in fields if f not in n]
    return out


def test_operator_objects_carry_their_required_fields(rendered):
    for kind, required in CRD_REQUIRED.items():
        obj = _one(rendered, kind)
        assert obj["apiVersion"] == "monitoring.coreos.com/v1"
        assert _missing_required(obj, required) == [], kind
    broken = copy.deepcopy(_one(rendered, "PrometheusRule"))
    del broken["spec"]["groups"][0]["rules"][0]["expr"]
    assert _missing_required(broken, CRD_REQUIRED["PrometheusRule"]) == [".spec.groups[].rules[].expr"]
    for rule in _one(rendered, "PrometheusRule")["spec"]["groups"][0]["rules"]:
        assert ("record" in rule) != ("alert" in rule), rule


def test_prometheus_rule_and_dashboards_are_the_generated_ones(rendered):
    with open(rules.RULES_PATH, encoding="utf-8") as f:
        assert _one(rendered, "PrometheusRule")["spec"]["groups"] == yaml.safe_load(f)["groups"]
    cm = _one(rendered, "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    for path in (dashboards.DASHBOARD_PATH, dashboards.FLEET_PATH):
        with open(path, encoding="utf-8") as f:
            assert json.loads(cm["data"][os.path.basename(path)]) == json.load(f)


def test_sidecar_pattern(rendered):
    pod = _one(rendered, "StatefulSet")["spec"]["template"]["spec"]
    assert pod["shareProcessNamespace"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    containers = {c["name"]: c for c in pod["containers"]}
    assert set(containers) == {"inference", "easymats"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    seg = volumes["segments"]["emptyDir"]
    assert seg["medium"] == "Memory"
    dirs = set()
    for c in containers.values():
        assert c["securityContext"]["readOnlyRootFilesystem"] is True, c["name"]
        assert c["securityContext"]["allowPrivilegeEscalation"] is False, c["name"]
        mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "segments")
        env = {e["name"]: e["value"] for e in c.get("env", [])}
        assert env["EASYMATS_SEGMENT_DIR"].startswith(mount + "/"), c["name"]
        dirs.add(env["EASYMATS_SEGMENT_DIR"])
    assert len(dirs) == 1  # the runtime publishes where the agent reads
    agent = containers["easymats"]
    res = agent["resources"]
    assert {"cpu", "memory"} <= set(res["requests"]) and {"cpu", "memory"} <= set(res["limits"])
    args = dict(a.lstrip("-").split("=", 1) for a in agent["args"] if "=" in a)
    token_mount = next(m for m in agent["volumeMounts"] if m["name"] == "webhook-token")
    assert args["webhook-token-file"].startswith(token_mount["mountPath"] + "/") and token_mount["readOnly"]
    assert volumes["webhook-token"]["secret"]["secretName"] == "easymats-webhook-token"
    ports = {p["name"]: p["containerPort"] for p in agent["ports"]}
    assert args["listen"].endswith(f":{ports['metrics']}") and args["webhook-listen"].endswith(f":{ports['webhook']}")


def test_service_monitor_scrapes_the_agent_as_job_easymats_with_the_node_label(rendered):
    svc, sm = _one(rendered, "Service"), _one(rendered, "ServiceMonitor")
    pod_labels = _one(rendered, "StatefulSet")["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["clusterIP"] == "None"  # per-pod DNS for the per-pod webhook route
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]} and endpoint["port"] == "metrics"
    relabel = {r["targetLabel"]: r for r in endpoint["relabelings"]}
    assert relabel["node"]["sourceLabels"] == ["__meta_kubernetes_pod_node_name"]
    assert relabel["job"]["replacement"] == rules.AGENT_JOB


def _copies() -> list[str]:
    with open(DOCKERFILE, encoding="utf-8") as f:
        lines = [line.split() for line in f if line.startswith("COPY ")]
    return [src for parts in lines for src in parts[1:-1]]


def test_dockerfile_copies_files_that_exist_and_the_manifest_uses_its_image(rendered):
    sources = _copies()
    assert {"pyproject.toml", "easymats/"} <= set(sources)
    for src in sources:
        assert os.path.exists(os.path.join(ROOT, src)), f"Dockerfile copies {src}, which does not exist"
    with open(DOCKERFILE, encoding="utf-8") as f:
        text = f.read()
    assert "torch" not in re.sub(r"#.*", "", text)
    assert re.search(r"^USER 1000", text, re.M)
    agent = next(c for c in _one(rendered, "StatefulSet")["spec"]["template"]["spec"]["containers"]
                 if c["name"] == "easymats")
    assert agent["image"].split(":")[0] == "easymats"


def test_dockerfile_pip_install_works_in_a_clean_venv_without_torch(tmp_path):
    """The Dockerfile's `pip install` on exactly the files it copies, in a fresh venv."""
    src = tmp_path / "src"
    src.mkdir()
    for item in _copies():
        path = os.path.join(ROOT, item)
        if os.path.isdir(path):
            shutil.copytree(path, src / item.rstrip("/"), ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(path, src / item)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-compile", str(src)],
                         capture_output=True, text=True)
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    py = str(venv / "bin" / "python")
    check = subprocess.run([py, "-c", "import importlib.util as u, easymats.agent, easymats.cli; "
                            "print([m for m in ('torch', 'transformers', 'triton') if u.find_spec(m)])"],
                           capture_output=True, text=True, cwd=tmp_path)
    assert check.returncode == 0 and check.stdout.strip() == "[]", check.stdout + check.stderr
    version = subprocess.run([str(venv / "bin" / "easymats"), "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and "easymats" in version.stdout, version.stderr
