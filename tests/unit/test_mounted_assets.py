"""The OpenAI service finds the live build's tokenizer files in a repository mounted from a host folder (GPU targets)
as it does in S3: the same files, under a content key, published atomically."""

from __future__ import annotations

import json
from types import SimpleNamespace

from stoker.serving.backend_repo import mounted_repository
from stoker.serving.openai_service import fetch_assets


def _container(host, args):
    return SimpleNamespace(name="stoker-x-blue", labels={"ai.stoker.repo_digest": "d" * 64},
                           attrs={"Args": args, "Mounts": [{"Source": str(host), "Destination": "/models"}]})


def test_a_mounted_llmapi_checkpoints_tokenizer_is_the_live_builds(tmp_path):
    ckpt = tmp_path / "repo" / "tensorrt_llm" / "1" / "checkpoint"
    ckpt.mkdir(parents=True)
    (ckpt / "tokenizer.json").write_text('{"model": {}}')
    (ckpt / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    (ckpt / "model.safetensors").write_bytes(b"weights are not assets")
    c = _container(tmp_path / "repo", ["tritonserver", "--model-repository=/models", "--http-port=1"])
    assert mounted_repository(c) == tmp_path / "repo"
    entry = fetch_assets(c, tmp_path / "state")
    copied = tmp_path / "state" / entry["assets"]
    assert sorted(p.name for p in copied.iterdir()) == ["config.json", "tokenizer.json"]
    assert entry["digest"] == "d" * 64 and entry["version"] == 1 and entry["repository"] == str(tmp_path / "repo")
    assert fetch_assets(c, tmp_path / "state") == entry  # unchanged files: the same key, nothing copied again


def test_an_s3_repository_is_not_a_mount(tmp_path):
    c = _container(tmp_path, ["--model-repository=s3://127.0.0.1:9000/bkt/key"])
    assert mounted_repository(c) is None
