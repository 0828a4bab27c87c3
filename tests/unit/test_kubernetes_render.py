"""`stoker render --kubernetes`: pure rendering, the rollout strategy from GPU headroom, refusals in one line, and
every example spec's objects validated strictly offline (the CI check: kubernetes-validate's bundled schemas; for the
HTTPRoute stoker's field list and @kubernetes-models/gateway-api's validator, which `make venv-dev` installs: without it
these tests fail saying so; no network, no cluster)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from stoker.commands.render import RenderError, render_kubernetes
from stoker.errors import PlanRefused
from stoker.kubernetes import objects, strategy, validate, workpool
from stoker.spec.schema import Spec

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "deployments" / "specs").glob("*.yaml"))
DIGEST = "ab" * 32


def _spec(**over) -> Spec:
    from stoker.spec.load import parse_spec

    doc = {"version": 1, "model": {"repo_id": "org/tiny"}, "storage": {"bucket": "stoker-k8s"},
           "deploy": {"name": "tiny"}, "kubernetes": {}}
    for key, value in over.items():
        doc[key] = value if not isinstance(value, dict) else {**doc.get(key, {}), **value}
    return parse_spec(doc)


def _gpu(count: int, replicas: int = 1, rollout: str = "auto", tensor: int = 1, **k8s) -> Spec:
    return _spec(target="tensorrt", gpus={"type": "h100-80gb", "count": count, "rollout": rollout},
                 parallel={"tensor": tensor}, kubernetes=k8s,
                 deploy={"name": "llm", "replicas": replicas, "image": "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"})


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_spec_renders_and_validates_strictly(path, tmp_path):
    out = render_kubernetes(path, tmp_path, DIGEST)
    written = list(yaml.safe_load_all(out["files"][0].read_text()))
    assert written == out["objects"]  # the file is the objects, nothing lost in YAML
    objs = [*written, workpool.filled_manifest(out["work_pool"])]
    for obj, against in zip(objs, validate.validate_all(objs), strict=True):
        assert against, obj["kind"]
    assert {o["kind"] for o in written} >= {"Deployment", "Service", "PodDisruptionBudget"}


def test_example_full_has_every_kind(tmp_path):
    out = render_kubernetes(ROOT / "deployments" / "specs" / "example-full.yaml", tmp_path, DIGEST)
    kinds = [o["kind"] for o in out["objects"]]
    assert kinds == ["Deployment", "Service", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "Service",
                     "HTTPRoute"]
    route = out["objects"][-1]
    name = out["objects"][0]["metadata"]["name"].removesuffix("-blue")
    assert [(b["name"], b["weight"]) for b in route["spec"]["rules"][0]["backendRefs"]] == [
        (f"{name}-blue", 90), (f"{name}-green", 10)]  # canary_percent 10 to the colour that is not live
    assert out["objects"][5]["spec"]["selector"]["stoker.dev/colour"] == "blue"  # the stable Service: the live colour


def test_deployment_syncs_then_serves_with_health_probes():
    spec = _spec(storage={"endpoint_url": "http://s3.local:9000"})
    dep = objects.deployment(spec, strategy.derive(spec), "blue", DIGEST)
    pod = dep["spec"]["template"]["spec"]
    sync = pod["initContainers"][0]
    assert sync["command"][:3] == ["stoker", "sync-repo", "/var/lib/stoker-sync/model_repository"]
    assert sync["command"][sync["command"].index("--digest") + 1] == DIGEST
    triton = pod["containers"][0]
    assert triton["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert triton["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert triton["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert "--http-address=0.0.0.0" in triton["args"] and not any("127.0.0.1" in a for a in triton["args"])
    assert {"name": "repository", "mountPath": "/models", "subPath": "model_repository", "readOnly": True} in \
        triton["volumeMounts"]
    assert pod["volumes"][1]["emptyDir"] == {"medium": "Memory", "sizeLimit": "256Mi"}  # docker's 256m, not milli


def test_gpu_pod_limits_and_surge_with_a_spare_gpu():
    spec = _gpu(count=2)
    chosen = strategy.derive(spec)
    assert chosen.deployment_strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    triton = objects.deployment(spec, chosen, "blue", DIGEST)["spec"]["template"]["spec"]["containers"][0]
    assert triton["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    assert triton["command"][0] == "tritonserver"  # the GPU image's entrypoint is not tritonserver


@pytest.mark.parametrize("count,replicas,tensor,rollout,k8s,want", [
    (2, 2, 1, "auto", {}, ("one-at-a-time", 0, 1)),
    (3, 2, 1, "auto", {}, ("surge", 1, 0)),
    (8, 2, 2, "auto", {}, ("surge", 2, 0)),  # 4 spare GPUs hold two 2-GPU pods: surge capped at the replicas
    (1, 1, 1, "reload", {}, ("recreate", None, None)),
    (1, 1, 1, "auto", {"accept_downtime": True}, ("recreate", None, None)),
])
def test_strategy_from_gpu_headroom(count, replicas, tensor, rollout, k8s, want):
    chosen = strategy.derive(_gpu(count, replicas, rollout, tensor, **k8s))
    rolling = chosen.deployment_strategy.get("rollingUpdate", {})
    assert (chosen.kind, rolling.get("maxSurge"), rolling.get("maxUnavailable")) == want


@pytest.mark.parametrize("spec,colour,words", [
    (lambda: _gpu(1), None, "one replica on 1 GPU(s) with no spare GPU"),
    (lambda: _gpu(2, rollout="shared"), None, "gpus.rollout: shared"),
    (lambda: _gpu(2, replicas=2, rollout="surge"), None, "gpus.rollout: surge needs 1 spare"),
    (lambda: _gpu(3, replicas=2), "green", "colour green beside the live blue needs 2 spare GPUs"),
    (lambda: _gpu(2, replicas=1, autoscaling={"max_replicas": 3, "queue_time_us": 100}), None, "need 3 GPUs"),
])
def test_refusals_are_one_line(spec, colour, words):
    with pytest.raises(PlanRefused) as err:
        strategy.derive(spec(), colour)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_canary_without_gateway_is_refused_at_load():
    with pytest.raises(Exception) as err:
        _spec(kubernetes={"canary_percent": 10})
    assert "canary_percent 10 needs kubernetes.gateway" in str(err.value)


def test_render_refuses_a_missing_digest_and_writes_nothing(tmp_path):
    with pytest.raises(RenderError):
        render_kubernetes(EXAMPLES[0], tmp_path, "")
    assert not (tmp_path / "kubernetes").exists()


def test_strict_validation_refuses_unknown_fields():
    spec = _spec(kubernetes={"gateway": "gw"})
    dep = objects.deployment(spec, strategy.derive(spec), "blue", DIGEST)
    dep["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(validate.Invalid, match="readinessProbes"):
        validate.validate(dep)
    route = objects.http_route(spec)
    route["spec"]["rules"][0]["backendRefs"][0]["wieght"] = 5
    with pytest.raises(validate.Invalid, match="wieght"):
        validate.validate(route)


def test_http_route_is_checked_by_the_gateway_api_validator_too():
    spec = _spec(kubernetes={"gateway": "gw"})
    routes = [objects.http_route(spec) for _ in range(3)]
    routes[1]["spec"]["rules"][0]["backendRefs"][0]["port"] = 70000  # a field stoker renders, out of its range
    routes[2]["spec"]["parentRefs"][0]["name"] = ""
    first, port, parent = validate.check_all(routes)  # one node process for the three
    assert first == ["stoker's HTTPRoute fields", f"gateway-api {validate.GATEWAY_API}"]
    assert isinstance(port, validate.Invalid) and "/spec/rules/0/backendRefs/0/port: maximum" in str(port)
    assert isinstance(parent, validate.Invalid) and "/spec/parentRefs/0/name: minLength" in str(parent)
    assert validate.GATEWAY_API == "v1.5.1"  # what @kubernetes-models/gateway-api 2.0.0 was generated from


def test_work_pool_job_is_valid_where_prefect_kubernetes_default_is_not():
    spec = _gpu(2)
    job = workpool.filled_manifest(workpool.base_job_template(spec))
    assert validate.validate(job)
    assert job["spec"]["template"]["spec"]["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    # prefect-kubernetes 0.8.0's default places these two in the pod template's spec: refused there.
    moved = copy.deepcopy(job)
    for key in ("parallelism", "completions"):
        moved["spec"]["template"]["spec"][key] = moved["spec"].pop(key)
    with pytest.raises(validate.Invalid, match="parallelism"):
        validate.validate(moved)


def test_the_admin_token_is_in_no_rendered_argv_and_the_shim_is_preloaded(tmp_path, monkeypatch):
    """Kubernetes expands $(VAR) into a container's argv, where every local user of the node reads it: the args carry
    the placeholder, the token comes from the Secret as env, and the argv_secret shim (written beside the objects,
    mounted from its ConfigMap) swaps it in inside each tritonserver (issue 51)."""
    from stoker.containers import argv_secret

    monkeypatch.setenv("STOKER_HOME", str(tmp_path / "home"))
    out = render_kubernetes(ROOT / "deployments" / "specs" / "example-full.yaml", tmp_path, DIGEST)
    pod = out["objects"][0]["spec"]["template"]["spec"]
    triton = pod["containers"][0]
    argv = triton.get("command", []) + triton.get("args", [])
    assert not [a for a in argv if "$(" in a], argv
    assert sum(a.endswith(f":stoker-admin={argv_secret.PLACEHOLDER}") for a in argv) >= 2, argv
    env = {e["name"]: e for e in triton["env"]}
    assert env[argv_secret.VARIABLE]["valueFrom"]["secretKeyRef"]["key"] == "token"
    assert env["LD_PRELOAD"]["value"] == argv_secret.CONTAINER_PATH
    mount = next(m for m in triton["volumeMounts"] if m["name"] == "argv-secret")
    volume = next(v for v in pod["volumes"] if v["name"] == "argv-secret")
    assert mount["mountPath"] == argv_secret.CONTAINER_DIR and mount["readOnly"]
    assert "optional" not in volume["configMap"] and volume["configMap"]["items"][0]["path"] == "argv_secret.so"
    shim = out["files"][-1]
    assert shim.parent == out["files"][0].parent and shim.read_bytes() == argv_secret.build().read_bytes()
