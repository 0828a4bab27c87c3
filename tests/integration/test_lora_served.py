"""LoRA adapters as a user meets them: a spec with an adapter from the Hub (olah mirror), `stoker run` end to end on
real servers (S3, Docker, the CPU Triton image, HAProxy), then the official `openai` client at the stable address.

The adapter's answers equal transformers + PEFT on the base (format none, greedy), the base's equal transformers',
/v1/models lists the adapter with the base as its parent, an unknown adapter is a 404 (OpenAI) or a one-line error
(Triton) and nothing else is affected. A new adapter commit reuses the fetched base and its build (cache hits) and
only fetches the adapter, packages, uploads, stages and switches; the adapter then answers as its new revision, and
`stoker rollback` brings back the previous one.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml
from operate_helpers import make_spec, stoker, stoker_env

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


def _greedy(base: Path, adapter: Path | None) -> tuple[str, list[float]]:
    """transformers (+ PEFT with ``adapter``) greedy on the unquantized base, decoded as the service decodes, and
    each generated token's log-softmax."""
    import torch

    tok = transformers.AutoTokenizer.from_pretrained(str(base))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, str(adapter)).eval()
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, do_sample=False,
                             min_new_tokens=N, pad_token_id=tok.pad_token_id)
        new = out[0, ids.shape[1]:]
        logits = model(input_ids=out).logits[0, ids.shape[1] - 1: -1].float()
        # min_tokens = N holds the end id off at every one of these positions: the distribution drawn from (whose
        # log-softmax the service reports, docs/serving.md) has it masked, as transformers' min_new_tokens does.
        logits[:, tok.eos_token_id] = float("-inf")
        rows = torch.log_softmax(logits, -1)
    return tok.decode(new, skip_special_tokens=True), rows[torch.arange(len(new)), new].tolist()


def _greedy_text(base: Path, adapter: Path | None) -> str:
    return _greedy(base, adapter)[0]


def _run(spec: dict, tmp: Path, env: dict) -> dict:
    path = tmp / f"spec-{uuid.uuid4().hex[:4]}.yaml"
    path.write_text(yaml.safe_dump(spec))
    r = stoker(["run", str(path)], env=env, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return json.loads(Path(r.stdout.strip().splitlines()[-1].removeprefix("manifest: ")).read_text())


def _complete(client, model: str) -> str:
    # min_tokens: the tiny model may pick its end id early; the same N tokens on both sides.
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0,
                                     extra_body={"min_tokens": N}).choices[0].text


def test_an_adapter_is_served_exactly_and_a_new_revision_needs_no_rebuild(tmp_path, local_stack, triton_image,
                                                                          worker_prefect_api):
    from stoker.stack.hub_mirror import publish_model

    base = local_stack["repos"] / "models" / local_stack["repo_id"]
    v1 = _adapter(base, tmp_path / "v1", seed=1)
    publish_model(local_stack["repos"], ADAPTER_REPO, v1, "a tiny LoRA adapter, v1")
    name = f"lora-{uuid.uuid4().hex[:6]}"
    spec = make_spec(local_stack, name)
    spec["adapters"] = [{"name": "tiny-lora", "repo_id": ADAPTER_REPO, "revision": "main"}]
    # Small but real: each adapter scored on the candidate against the same adapter on the unquantized build.
    spec["evaluation"] = {"max_windows": 2, "prompts": 2, "window_tokens": 32, "prompt_tokens": 8, "greedy_tokens": 8}
    env = stoker_env(tmp_path, worker_prefect_api, local_stack)
    try:
        first = _run(spec, tmp_path, env)
        assert first["status"] == "completed" and first["steps"]["adapters"]["status"] == "completed"
        task_id = first["steps"]["package"]["detail"]["adapters"]["tiny-lora"]
        evaluation = first["evaluation"]
        agreement = evaluation["candidate"]["adapters"]["tiny-lora"]["agreement"]
        assert evaluation["passed"] and agreement["token_match_rate"] == 1.0
        assert any(r["metric"].startswith("tiny-lora: ") for r in evaluation["rows"])
        # The benchmark step measured the adapter under the same load as the base.
        [level] = first["benchmark"]["adapters"]["tiny-lora"]
        assert level["requests"] == first["benchmark"]["levels"][0]["requests"] and level["errors"] == 0
        http = first["endpoint"]["http"]
        # `stoker bench --adapter`: the base, then the adapter selected per request (its lora_task_id).
        bench = stoker(["bench", "--url", first["endpoint"]["grpc"], "--adapter", "tiny-lora", "--requests", "4",
                        "--output-tokens", "8", "--quiet", "--out", str(tmp_path / "bench")], env=env, timeout=300)
        assert bench.returncode == 0 and "adapter tiny-lora:" in bench.stdout, bench.stdout + bench.stderr[-2000:]
        measured = json.loads((tmp_path / "bench" / "adapters" / "tiny-lora" / "summary.json").read_text())
        assert measured["adapter"] == "tiny-lora" and measured["levels"][0]["errors"] == 0
        assert measured["levels"][0]["requests"] == 4
        client = openai.OpenAI(base_url=f"{http}/v1", api_key="unused")

        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {name, "tiny-lora"} and cards["tiny-lora"].parent == name
        want_base = _greedy_text(base, None)
        want_v1, v1_log_probs = _greedy(base, v1)
        assert want_v1 != want_base  # the adapter changes the answer
        assert _complete(client, name) == want_base
        assert _complete(client, "tiny-lora") == want_v1
        # Issue 50 item 5: the adapter's log probs are PEFT's log-softmax, and a schema constrains its answer.
        scored = client.completions.create(model="tiny-lora", prompt=PROMPT, max_tokens=N, temperature=0, logprobs=1,
                                           extra_body={"min_tokens": N}).choices[0]
        assert scored.text == want_v1
        assert max(abs(a - b) for a, b in zip(scored.logprobs.token_logprobs, v1_log_probs, strict=True)) < 1e-4
        shaped = client.chat.completions.create(
            model="tiny-lora", messages=[{"role": "user", "content": PROMPT}], max_tokens=48, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "word", "strict": True, "schema": {
                "type": "object", "properties": {"w": {"type": "string", "maxLength": 4}}, "required": ["w"]}}})
        assert shaped.choices[0].finish_reason == "stop", shaped
        assert set(json.loads(shaped.choices[0].message.content)) == {"w"}

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

        # `stoker rollback NAME` serves the previous adapter set again, at the same address.
        r = stoker(["rollback", name], env=env, timeout=300)
        assert r.returncode == 0 and first["run_id"] in r.stdout, (r.stdout + r.stderr)[-2000:]
        assert _complete(client, "tiny-lora") == want_v1 and _complete(client, name) == want_base
    finally:
        engine.remove_deployment(engine.connect(), name, lambda _m: None)


def test_the_engine_target_serves_the_adapter_converted_and_preloaded_on_the_standin(tmp_path, local_stack,
                                                                                     standin_image, worker_prefect_api):
    """`target: tensorrt` with an adapter, on the STAND-IN (not TensorRT-LLM): the package converts the adapter to
    TensorRT-LLM's format into the backend's lora_prefetch_dir; the stand-in's runtime serves those files, and its
    answers through the OpenAI API at the stable address are transformers + PEFT's."""
    from operate_helpers import manifest_of, stoker
    from standin_kit import gpu_spec_data

    from stoker.stack.hub_mirror import publish_model

    base = local_stack["repos"] / "models" / local_stack["repo_id"]
    adapter = _adapter(base, tmp_path / "a", seed=3)
    repo = f"stoker/tiny-lora-engine-{uuid.uuid4().hex[:4]}"
    publish_model(local_stack["repos"], repo, adapter, "a tiny LoRA adapter for the engine target")
    spec = gpu_spec_data(local_stack, "tensorrt", "stl", openai=True)
    spec["adapters"] = [{"name": "tiny-lora", "repo_id": repo}]
    spec["quantization"] = {"format": "none"}  # its own baseline: the quantized rebuilds are test_standin_tensorrt's
    spec["evaluation"] = {"max_windows": 2, "prompts": 2, "window_tokens": 32, "prompt_tokens": 8, "greedy_tokens": 8}
    path = tmp_path / "spec.yaml"
    env = stoker_env(tmp_path, worker_prefect_api, local_stack, standin=True)
    name = spec["deploy"]["name"]
    try:
        path.write_text(yaml.safe_dump(spec))  # the demo model is bfloat16: refused before any download
        refused = stoker(["plan", str(path)], env, timeout=300)
        assert refused.returncode == 1 and "needs a float16 engine, and this one would be bfloat16" in refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
        spec["build"] = {"dtype": "float16"}
        path.write_text(yaml.safe_dump(spec))
        run = stoker(["run", str(path)], env)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        m = manifest_of(run)
        assert m["status"] == "completed" and m["standin"]["ran"] is True
        package = m["steps"]["package"]["detail"]
        task_id = package["adapters"]["tiny-lora"]
        assert package["lora"]["tiny-lora"]["task_id"] == task_id and package["lora"]["tiny-lora"]["rows"] > 0
        evaluation = m["evaluation"]
        assert evaluation["passed"] and "tiny-lora" in evaluation["candidate"]["adapters"]
        assert m["benchmark"]["adapters"]["tiny-lora"][0]["errors"] == 0
        [backend] = engine.containers(engine.connect(), name, role=engine.ROLE_BACKEND)
        config = backend.exec_run(["cat", "/models/tensorrt_llm/config.pbtxt"]).output.decode()
        assert '"lora_prefetch_dir"' in config and "/models/tensorrt_llm/1/lora" in config
        listed = backend.exec_run(["ls", f"/models/tensorrt_llm/1/lora/{task_id}"]).output.decode().split()
        assert sorted(listed) == ["model.lora_config.npy", "model.lora_weights.npy"]

        client = openai.OpenAI(base_url=f"{m['endpoint']['http']}/v1", api_key="unused")
        cards = {c.id: c for c in client.models.list().data}
        assert cards["tiny-lora"].parent == name
        want_base, want = _greedy_text(base, None), _greedy_text(base, adapter)
        assert want != want_base
        assert _complete(client, "tiny-lora") == want
        assert _complete(client, name) == want_base

        # Issue 50 on the engine target's contract, served by the stand-in: the rendered config turns on
        # TensorRT-LLM's xgrammar backend over the tokenizer info file the package wrote, and a guide goes in as
        # `guided_decoding_guide_type` / `guided_decoding_guide`; only the sampled token's log prob comes back
        # (the engine has no top-k output), and penalties, a seed per choice and n map to its own inputs.
        assert '"guided_decoding_backend"' in config and "xgrammar" in config and "xgrammar_tokenizer_info" in config
        shaped = client.chat.completions.create(
            model="tiny-lora", messages=[{"role": "user", "content": PROMPT}], max_tokens=48, temperature=0,
            logprobs=True, response_format={"type": "json_schema", "json_schema": {"name": "word", "schema": {
                "type": "object", "properties": {"w": {"type": "string", "maxLength": 4}}, "required": ["w"]}}})
        assert shaped.choices[0].finish_reason == "stop" and set(json.loads(shaped.choices[0].message.content)) == {
            "w"}, shaped
        assert len(shaped.choices[0].logprobs.content) == shaped.usage.completion_tokens
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=name, messages=[{"role": "user", "content": PROMPT}], max_tokens=2,
                                           logprobs=True, top_logprobs=2)
        assert err.value.body["param"] == "top_logprobs"
        ask = dict(model=name, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=7, presence_penalty=0.5)
        many = client.completions.create(n=2, **ask)
        assert [c.text for c in many.choices] == [client.completions.create(**{**ask, "seed": 7 + i}).choices[0].text
                                                  for i in range(2)]
    finally:
        engine.remove_deployment(engine.connect(), name, lambda _m: None)
