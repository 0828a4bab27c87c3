"""Bad input ends with a one-line cause, before heavy work, leaving no cache entry behind."""

from __future__ import annotations

import socket

import pytest
import yaml
from operate_helpers import free_base_port, stoker, stoker_env

from stoker.demo import DEMO_SPEC

pytestmark = [pytest.mark.s3, pytest.mark.hub, pytest.mark.prefect]


def _run(tmp_path, local_stack, worker_prefect_api, edit, args=("run",)):
    data = yaml.safe_load(DEMO_SPEC.read_text())
    data["model"]["endpoint"] = local_stack["hub"]
    data["storage"]["endpoint_url"] = local_stack["s3"]
    data["deploy"]["name"] = "bad-input"
    data.pop("adapters")  # one input under test at a time; adapters' bad input: tests/unit/test_lora.py
    # Free ports of its own: the demo's (8000-8002) may be held by another test file's demo deployment meanwhile,
    # and preflight would refuse them before reaching the input under test.
    base = free_base_port()
    data["deploy"]["ports"] = {"http": base, "grpc": base + 1, "metrics": base + 2}
    edit(data)
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    env = stoker_env(tmp_path, worker_prefect_api, local_stack)
    r = stoker([*args, str(spec)], env=env, timeout=300)
    err_lines = [line for line in r.stderr.splitlines() if line.startswith("stoker: error:")]
    return r, err_lines


def _no_cache(tmp_path):
    cache = tmp_path / "home" / "cache"
    return not cache.exists() or not any(p for p in cache.rglob("record.json"))


def test_unknown_quant_format_is_refused_naming_the_field(tmp_path, local_stack, worker_prefect_api):
    r, err = _run(tmp_path, local_stack, worker_prefect_api, lambda d: d["quantization"].update(format="fp4"))
    assert r.returncode == 1
    assert len(err) == 1
    assert err[0].startswith(f"stoker: error: {tmp_path / 'spec.yaml'}: quantization.format: Input should be "
                             "'none', 'fp8', 'int4_awq'"), err


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d["model"].update(repo_id="stoker/does-not-exist"), "stoker/does-not-exist"),
    (lambda d: d["model"].update(revision="no-such-branch"), "no-such-branch"),
])
def test_unknown_repo_or_revision(tmp_path, local_stack, worker_prefect_api, triton_image, edit, needle):
    r, err = _run(tmp_path, local_stack, worker_prefect_api, edit)
    assert r.returncode == 1 and len(err) == 1, r.stderr[-2000:]
    assert needle in err[0]
    assert _no_cache(tmp_path)


def test_unreachable_s3_fails_in_preflight(tmp_path, local_stack, worker_prefect_api):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    r, err = _run(tmp_path, local_stack, worker_prefect_api,
                  lambda d: d["storage"].update(endpoint_url=f"http://127.0.0.1:{dead}"))
    assert r.returncode == 1 and len(err) == 1, r.stderr[-2000:]
    assert "unreachable" in err[0] and str(dead) in err[0]
    assert _no_cache(tmp_path)


def test_no_docker_daemon_fails_in_preflight(tmp_path, local_stack, worker_prefect_api):
    r, err = _run(tmp_path, local_stack, worker_prefect_api,
                  lambda d: d["deploy"].update(docker_host=f"unix://{tmp_path}/no-docker.sock"))
    assert r.returncode == 1 and len(err) == 1, r.stderr[-2000:]
    assert "no Docker daemon" in err[0]
    assert _no_cache(tmp_path)


@pytest.mark.docker
def test_port_in_use_fails_in_preflight(tmp_path, local_stack, worker_prefect_api, triton_image):
    with socket.socket() as squatter:
        squatter.bind(("0.0.0.0", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        r, err = _run(tmp_path, local_stack, worker_prefect_api,
                      lambda d: d["deploy"].update(ports={"http": port, "grpc": port + 1, "metrics": port + 2}))
    assert r.returncode == 1 and len(err) == 1, r.stderr[-2000:]
    assert f"port {port}" in err[0] and "in use" in err[0]
    assert _no_cache(tmp_path)


@pytest.mark.parametrize("args", [("plan",), ("run",)])
def test_unknown_hub_eval_dataset_is_refused_before_any_heavy_step(tmp_path, local_stack, worker_prefect_api, args):
    r, err = _run(tmp_path, local_stack, worker_prefect_api, lambda d: d.setdefault("evaluation", {}).update(
        dataset={"repo_id": "stoker/no-such-eval-set", "path": "eval.txt"}), args)
    assert r.returncode == 1 and len(err) == 1, r.stderr[-2000:]
    assert "dataset stoker/no-such-eval-set" in err[0]
    assert _no_cache(tmp_path)


def test_evaluation_text_shorter_than_a_window_is_refused_at_plan(tmp_path, local_stack, worker_prefect_api):
    short = tmp_path / "short.txt"
    short.write_text("Only a few words.")
    r, err = _run(tmp_path, local_stack, worker_prefect_api, lambda d: d.setdefault("evaluation", {}).update(
        text_file=str(short)), ("plan",))
    assert r.returncode == 1 and len(err) == 1, r.stderr[-2000:]
    assert "shorter than one window of 64 tokens (evaluation.window_tokens)" in err[0]
