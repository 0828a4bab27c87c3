"""The plan's deploy row says what will serve: replicas, each replica's GPUs, the address and its keys."""

from __future__ import annotations

from stoker.plan.compose import what_serves
from stoker.spec.schema import Spec


def _spec(**deploy) -> Spec:
    return Spec.model_validate({"model": {"repo_id": "org/m"}, "storage": {"bucket": "bkt"}, "deploy": deploy})


def test_one_cpu_replica_on_loopback():
    assert what_serves(_spec()) == "1 replica; listen http://127.0.0.1:8000 (gRPC :8001); no API keys (loopback)"


def test_replicas_with_their_gpus_and_the_next_builds_set(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("k\n")
    spec = _spec(replicas=2, listen="0.0.0.0", api_keys={"file": str(keys)})
    row = what_serves(spec, ((0, 1), (2, 3)))
    assert row == (f"2 replicas; GPUs 0 | 1, next build on 2 | 3; listen http://0.0.0.0:8000 (gRPC :8001); "
                   f"API keys required (file {keys})")


def test_tensor_parallel_replicas_each_name_their_set():
    assert what_serves(_spec(replicas=2), ((0, 1, 2, 3),)).startswith("2 replicas; GPUs 0,1 | 2,3;")
