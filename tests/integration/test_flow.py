"""The whole chain on real servers: Hub mirror, S3, Docker + Triton, Prefect's ephemeral API.

Each `stoker` call is a new process, so the rerun proves the cache survives one. Both runs, and the
demo model's generation, must print clean logs (clean_logs.py): a cold run in a fresh PREFECT_HOME is
where Prefect's telemetry used to fail. The demo spec serves a LoRA adapter beside the base, as `make demo` does.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import urllib.request
import uuid
from pathlib import Path

import boto3
import openai
import pytest
import yaml
from clean_logs import noise
from operate_helpers import free_base_port, manifest_of, stoker

from stoker.demo import DEMO_SPEC

pytestmark = [pytest.mark.docker, pytest.mark.s3, pytest.mark.hub, pytest.mark.prefect, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
HEAVY_STEPS = ("fetch", "quantize", "build", "package", "upload")


@pytest.fixture
def spec_file(tmp_path, local_stack):
    data = yaml.safe_load(DEMO_SPEC.read_text())
    base = free_base_port()
    data["model"]["endpoint"] = local_stack["hub"]
    data["storage"]["endpoint_url"] = local_stack["s3"]
    data["storage"]["bucket"] = f"it-{uuid.uuid4().hex[:8]}"
    data["deploy"]["name"] = f"it-{uuid.uuid4().hex[:6]}"
    data["deploy"]["ports"] = {"http": base, "grpc": base + 1, "metrics": base + 2}
    data["benchmark"].update({"concurrency": [1, 2], "requests_per_level": 4, "output_tokens": 16})
    data["evaluation"] = {"lm_eval": {"task": "stoker_cloze", "limit": 8}}  # lm-eval through the endpoint too
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    yield path, data
    from stoker.containers.engine import connect, remove_deployment

    remove_deployment(connect(), data["deploy"]["name"], lambda _m: None)


def _env(tmp_path, local_stack):
    # Cold for real: this Prefect home migrates its own database and registers its block types (no template from
    # make test-services).
    from stoker.stack.prefect_home import cold_env

    return {**cold_env(os.environ), **local_stack["aws_env"], "STOKER_HOME": str(tmp_path / "home"),
            "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_LOGGING_LEVEL": "INFO"}


def test_demo_spec_end_to_end_then_a_rerun_of_cache_hits(tmp_path, local_stack, triton_image, spec_file):
    path, data = spec_file
    env = _env(tmp_path, local_stack)

    first = stoker(["run", str(path)], env)
    assert first.returncode == 0, first.stderr[-4000:]
    assert noise("\n".join([*local_stack["model_log"], first.stdout, first.stderr])) == []
    m1 = manifest_of(first)
    assert m1["status"] == "completed"
    assert all(m1["steps"][s]["status"] == "completed" for s in (*HEAVY_STEPS, "deploy", "benchmark"))
    assert not any(m1["steps"][s]["cache_hit"] for s in (*HEAVY_STEPS, "deploy"))
    # The resolved sha is the mirror's git commit.
    git_sha = subprocess.run(["git", "-C", str(local_stack["repos"] / "models" / local_stack["repo_id"]),
                              "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert m1["model"]["sha"] == git_sha
    # fp8 really happened: the quantize step checked the export structurally.
    assert m1["steps"]["quantize"]["detail"]["format"] == "fp8"
    # Evaluated on the candidate before it served, against the unquantized build checked against transformers.
    ev = m1["evaluation"]
    assert ev["passed"] and ev["baseline"]["check"]["passed"]
    assert ev["baseline"]["check"]["max_abs_log_prob_diff"] <= ev["baseline"]["check"]["tolerance"]
    assert ev["candidate"]["perplexity"] > 1 and 0 <= ev["candidate"]["agreement"]["token_match_rate"] <= 1
    task = ev["candidate"]["task"]
    assert task["task"] == "stoker_cloze" and task["n"] == 8 and 0 <= task["score"] <= 1
    order = list(m1["steps"])
    assert order.index("benchmark") < order.index("evaluate") < order.index("gate") < order.index("switch")
    for level in m1["benchmark"]["levels"]:
        assert level["errors"] == 0 and level["requests"] == 4
        assert level["ttft_ms"]["p50"] > 0 and level["output_tokens_per_s"] > 0

    # The repository and the manifest are in S3; the manifest there equals the local one.
    aws = local_stack["aws_env"]
    s3 = boto3.client("s3", endpoint_url=local_stack["s3"], region_name="us-east-1",
                      aws_access_key_id=aws["AWS_ACCESS_KEY_ID"], aws_secret_access_key=aws["AWS_SECRET_ACCESS_KEY"])
    bucket = data["storage"]["bucket"]
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]}
    assert any(k.endswith("tensorrt_llm/config.pbtxt") for k in keys)
    assert any(k.endswith("ensemble/1/") for k in keys)
    remote = json.loads(s3.get_object(Bucket=bucket, Key=f"demo/runs/{m1['run_id']}/manifest.json")["Body"].read())
    assert remote["steps"]["upload"] == m1["steps"]["upload"]

    # The endpoint streams text over HTTP SSE, as the printed curl does.
    body = json.dumps({"text_input": "The quick brown fox", "max_tokens": 8, "stream": True}).encode()
    req = urllib.request.Request(f"{m1['endpoint']['http']}/v2/models/ensemble/generate_stream", data=body)
    with urllib.request.urlopen(req, timeout=60) as resp:
        events = [json.loads(line[5:]) for line in resp.read().decode().splitlines() if line.startswith("data:")]
    assert len(events) >= 2 and all("text_output" in e for e in events)
    assert "curl -sN -X POST" in first.stdout
    assert "LoRA adapters: 'demo-lora'" in first.stdout and "adapter demo-lora, concurrency 1:" in first.stdout

    # `stoker bench` counts tokens with the deployment's tokenizer: through the stable endpoint from the
    # run's manifest; through a backend's own port with no manifest here, from the repository in S3.
    tokenizer = next(o for o in m1["steps"]["package"]["outputs"]
                     if o["uri"].endswith("preprocessing/1/tokenizer/tokenizer.json"))
    for url, home, source in ((m1["endpoint"]["grpc"], env["STOKER_HOME"], "from its manifest"),
                              (m1["backend"]["grpc"], str(tmp_path / "elsewhere"), "from its repository in S3")):
        out = tmp_path / f"bench-{source.split()[-1]}"
        bench = stoker(["bench", "--url", url, "--requests", "2", "--warmup", "0", "--output-tokens", "4",
                         "--quiet", "--out", str(out)], {**env, "STOKER_HOME": home}, timeout=300)
        assert bench.returncode == 0, bench.stderr[-2000:]
        assert source in bench.stdout and "output tok/s" in bench.stdout, bench.stdout
        counting = json.loads((out / "summary.json").read_text())["counting"]
        assert counting["output_unit"] == "tokens" and counting["tokenizer_sha256"] == tokenizer["sha256"]

    # The demo's adapter (stoker/demo.yaml adapters): fetched, scored on the candidate, measured under the same load,
    # listed by the OpenAI API with the deployment as its parent and served per request with its own answer.
    assert m1["steps"]["adapters"]["status"] == "completed"
    assert ev["candidate"]["adapters"]["demo-lora"]["agreement"]["token_match_rate"] > 0
    assert [lv["errors"] for lv in m1["benchmark"]["adapters"]["demo-lora"]] == [0, 0]
    client = openai.OpenAI(base_url=f"{m1['endpoint']['http']}/v1", api_key="unused")
    cards = {c.id: c for c in client.models.list().data}
    assert set(cards) == {data["deploy"]["name"], "demo-lora"}
    assert cards["demo-lora"].parent == data["deploy"]["name"]
    answers = {model: client.completions.create(model=model, prompt="The quick brown fox", max_tokens=8, temperature=0,
                                                extra_body={"min_tokens": 8}).choices[0].text for model in cards}
    assert answers["demo-lora"] != answers[data["deploy"]["name"]], answers  # the adapter changes the answer
    # The README's OpenAI example, verbatim but for the address and the name (the demo's are 8000 and "demo").
    block = re.search(r"```python\n(from openai import OpenAI\n.*?)```", (ROOT / "README.md").read_text(), re.S)[1]
    block = block.replace("http://127.0.0.1:8000", m1["endpoint"]["http"])
    scope: dict = {}
    exec(block.replace('model="demo"', f'model="{data["deploy"]["name"]}"'), scope)  # noqa: S102 -- our README
    assert len(scope["shaped"].choices) == 2
    for choice in scope["shaped"].choices:
        assert choice.finish_reason == "stop" and json.loads(choice.message.content)["colour"] in ("red", "green",
                                                                                                   "blue")
        assert len(choice.logprobs.content) >= 1

    second = stoker(["run", str(path)], env)
    assert second.returncode == 0, second.stderr[-4000:]
    assert noise(second.stdout + second.stderr) == []
    m2 = manifest_of(second)
    assert m2["run_id"] != m1["run_id"]
    assert all(m2["steps"][s]["cache_hit"] for s in (*HEAVY_STEPS, "adapters", "deploy")), {
        s: m2["steps"][s]["cache_hit"] for s in m2["steps"]}
    # The same backend, measured with the same settings: its figures are reused, not measured again.
    assert m2["steps"]["benchmark"]["status"] == "completed" and m2["steps"]["benchmark"]["cache_hit"]
    assert m2["benchmark"]["levels"] == m1["benchmark"]["levels"]
    assert m2["steps"]["evaluate"]["cache_hit"] and m2["steps"]["baseline"]["cache_hit"]
    assert m2["evaluation"]["candidate"] == m1["evaluation"]["candidate"]
    assert m2["endpoint"] == m1["endpoint"]
    for s in HEAVY_STEPS:
        assert m2["steps"][s]["digest"] == m1["steps"][s]["digest"]

    # `stoker plan` agrees: every step up to deploy would hit.
    plan = stoker(["plan", str(path)], env, timeout=300)
    assert plan.returncode == 0, plan.stderr
    rows = {line.split()[0]: line.split()[1] for line in plan.stdout.splitlines()[2:]}
    assert rows == {"fetch": "hit", "adapters": "checked", "quantize": "hit", "build": "hit", "package": "hit",
                    "upload": "hit", "deploy": "hit", "benchmark": "hit", "evaluate": "runs"}, plan.stdout

    # A checkpoint with damaged scales (well-formed, wrong numbers) fails the evaluation gate in one line;
    # the candidate never serves and the first build still answers at the same address.
    from eval_faults import publish_damaged

    from stoker.cache.keys import quantize_key
    from stoker.spec.load import load_spec

    data["quantization"]["calibration"]["samples"] = 15  # a new quantize key; its cache entry is the damage
    data.pop("adapters")  # the gate under test is the base model's; the adapter was served and scored above
    damaged_spec = path.with_name("damaged.yaml")
    damaged_spec.write_text(yaml.safe_dump(data))
    good = Path(env["STOKER_HOME"]) / "cache" / "quantize" / m1["steps"]["quantize"]["key"] / "out"
    publish_damaged(Path(env["STOKER_HOME"]) / "cache", quantize_key(load_spec(damaged_spec),
                                                                     m1["steps"]["fetch"]["digest"]), good)
    third = stoker(["run", str(damaged_spec)], env)
    assert third.returncode != 0
    last = third.stderr.strip().splitlines()[-1]
    assert "evaluation failed:" in last and ("greedy agreement" in last or "perplexity" in last), last
    m3 = json.loads(sorted((Path(env["STOKER_HOME"]) / "runs").glob("*/manifest.json"))[-1].read_text())
    assert m3["status"] == "failed" and m3["evaluation"]["passed"] is False
    assert m3["steps"]["quantize"]["cache_hit"] and not m3["steps"]["build"]["cache_hit"]
    assert "switch" not in m3["steps"]
    assert m3["backend"]["digest"] == m1["backend"]["digest"]
    with urllib.request.urlopen(urllib.request.Request(
            f"{m1['endpoint']['http']}/v2/models/ensemble/generate", data=json.dumps(
                {"text_input": "The quick brown fox", "max_tokens": 4}).encode()), timeout=60) as resp:
        assert "text_output" in json.loads(resp.read())
