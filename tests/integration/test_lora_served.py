"""LoRA adapters as a user meets them: a spec with an adapter from the Hub (olah mirror), `stoker run` end to end on
real servers (S3, Docker, the CPU Triton image, HAProxy), then the official `openai` client at the stable address.

The adapter's answers equal transformers + PEFT on the base (format none, greedy), the base's equal transformers',
/v1/models lists the adapter with the base as its parent, an unknown adapter is a 404 (OpenAI) or a one-line error
(Triton) and nothing else is affected. A new adapter commit reuses the fetched base and its build (cache hits) and
only fetches the adapter, packages, uploads, stages and switches; the adapter then answers as its new revision.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml
from operate_helpers import ROOT, make_spec

from stoker.containers import engine

pytestmark = [pytest.mark.docker, pytest.mark.s3, pytest.mark.hub, pytest.mark.prefect, pytest.mark.slow]
openai = pytest.importorskip("openai")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

ADAPTER_REPO = "stoker/tiny-lora-test"
PROMPT = "The quick brown fox"
N = 10


def _adapter(base: Path, out: Path, seed: int) -> Path:
    subprocess.run([sys.executable, "-m", "stoker.workers.tinyadapter", "--base", str(base), "--out", str(out),
                    "--seed", str(seed)], check=True, capture_output=True, text=True, timeout=300)
    return out


def _greedy_text(base: Path, adapter: Path | None) -> str:
    """transformers (+ PEFT with ``adapter``) greedy on the unquantized base, decoded as the service decodes."""
    import torch

    tok = transformers.AutoTokenizer.from_pretrained(str(base))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, str(adapter)).eval()
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, do_sample=False,
                             min_new_tokens=N, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def _run(spec: dict, tmp: Path, env: dict) -> dict:
    path = tmp / f"spec-{uuid.uuid4().hex[:4]}.yaml"
    path.write_text(yaml.safe_dump(spec))
    r = subprocess.run([sys.executable, "-m", "stoker.cli", "run", str(path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return json.loads(Path(r.stdout.strip().splitlines()[-1].removeprefix("manifest: ")).read_text())


def _complete(client, model: str) -> str:
    # min_tokens: the tiny model may pick its end id early; the same N tokens on both sides.
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0,
                                     extra_body={"min_tokens": N}).choices[0].text


def test_an_adapter_is_served_exactly_and_a_new_revision_needs_no_rebuild(tmp_path, local_stack, triton_image):
    from stoker.stack.hub_mirror import publish_model

    base = local_stack["repos"] / "models" / local_stack["repo_id"]
    v1 = _adapter(base, tmp_path / "v1", seed=1)
    publish_model(local_stack["repos"], ADAPTER_REPO, v1, "a tiny LoRA adapter, v1")
    name = f"lora-{uuid.uuid4().hex[:6]}"
    spec = make_spec(local_stack, name)
    spec["adapters"] = [{"name": "tiny-lora", "repo_id": ADAPTER_REPO, "revision": "main"}]
    # Small but real: each adapter scored on the candidate against the same adapter on the unquantized build.
    spec["evaluation"] = {"max_windows": 2, "prompts": 2, "window_tokens": 32, "prompt_tokens": 8, "greedy_tokens": 8}
    env = {**os.environ, **local_stack["aws_env"], "STOKER_HOME": str(tmp_path / "home"),
           "PREFECT_HOME": str(tmp_path / "prefect"), "HF_HOME": str(tmp_path / "hf")}
    env.pop("PREFECT_API_URL", None)
    try:
        first = _run(spec, tmp_path, env)
        assert first["status"] == "completed" and first["steps"]["adapters"]["status"] == "completed"
        task_id = first["steps"]["package"]["detail"]["adapters"]["tiny-lora"]
        evaluation = first["evaluation"]
        assert evaluation["passed"] and evaluation["candidate"]["adapters"]["tiny-lora"]["agreement"]["token_match_rate"] == 1.0
        assert any(r["metric"].startswith("tiny-lora: ") for r in evaluation["rows"])
        http = first["endpoint"]["http"]
        client = openai.OpenAI(base_url=f"{http}/v1", api_key="unused")

        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {name, "tiny-lora"} and cards["tiny-lora"].parent == name
        want_base, want_v1 = _greedy_text(base, None), _greedy_text(base, v1)
        assert want_v1 != want_base  # the adapter changes the answer
        assert _complete(client, name) == want_base
        assert _complete(client, "tiny-lora") == want_v1

        # Unknown adapters: a 404 in OpenAI's shape; through Triton, one line naming what is served.
        with pytest.raises(openai.NotFoundError):
            _complete(client, "no-such-adapter")
        body = json.dumps({"text_input": PROMPT, "max_tokens": 4, "lora_task_id": task_id + 1}).encode()
        req = urllib.request.Request(f"{http}/v2/models/ensemble/generate", data=body,
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert "no such adapter in this repository (served: tiny-lora" in err.value.read().decode()
        assert _complete(client, "tiny-lora") == want_v1  # nothing else affected

        # A new adapter commit: the base's fetch and build are cache hits; the adapter, package and serving run.
        v2 = _adapter(base, tmp_path / "v2", seed=2)
        publish_model(local_stack["repos"], ADAPTER_REPO, v2, "a tiny LoRA adapter, v2")
        second = _run(copy.deepcopy(spec), tmp_path, env)
        steps = second["steps"]
        assert [s for s in ("fetch", "quantize", "build") if steps[s]["cache_hit"]] == ["fetch", "quantize", "build"]
        assert not steps["adapters"]["cache_hit"] and not steps["package"]["cache_hit"]
        assert steps["switch"]["status"] == "completed" and second["endpoint"] == first["endpoint"]
        want_v2 = _greedy_text(base, v2)
        assert want_v2 != want_v1 and _complete(client, "tiny-lora") == want_v2
        assert _complete(client, name) == want_base
    finally:
        engine.remove_deployment(engine.connect(), name, lambda _m: None)
