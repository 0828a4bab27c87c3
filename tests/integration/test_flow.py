"""The whole chain on real servers, from one cold `stoker demo`: Hub mirror, S3, Docker + Triton, a Prefect server.

One module-scoped cold build of the demo spec serves every check (it used to be built cold twice, here and in
test_demo_ui.py; CI's service tier is CPU-bound): a cold `stoker demo` in a fresh STOKER_HOME and a fresh, unseeded
Prefect home starts its own Hub mirror, S3 server, Prefect server (SQLite, UI) and process worker, registers
`build_and_deploy/demo`, builds (fp8 quantize, LoRA adapter, evaluation, benchmark), serves and prints clean logs:
a cold Prefect home is where Prefect's telemetry used to fail. Then, in order:
1. the cold run's manifest, S3 objects, endpoint, `stoker bench`, the adapter and the README's OpenAI example;
2. a run submitted from the Prefect UI's form in headless chromium (Debian's, driven by selenium through
   chromium-driver), executed by the demo's worker in a new process: a rerun of cache hits, which `stoker plan`
   agrees with;
3. a damaged checkpoint failing the evaluation gate (with an lm-eval task through the candidate's endpoint) while
   the first build still answers: a `stoker run` with its own temporary Prefect API in another cold Prefect home;
4. `stoker down` stopping what the demo started.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import urllib.request
from pathlib import Path

import boto3
import openai
import pytest
import yaml
from clean_logs import noise
from operate_helpers import manifest_of, stoker

import prefect_ui
from stoker.demo import DEMO_REPO, DEMO_SPEC
from stoker.stack.services import free_port, port_open

pytestmark = [pytest.mark.docker, pytest.mark.s3, pytest.mark.hub, pytest.mark.prefect, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
HEAVY_STEPS = ("fetch", "quantize", "build", "package", "upload")


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _post(url: str, body: dict) -> list | dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _down(env: dict) -> subprocess.CompletedProcess:
    return stoker(["down"], env, timeout=300)


@pytest.fixture(scope="module")
def demo(tmp_path_factory, triton_image):
    """One cold `stoker demo`; `stoker down` after the module if test_down_stops_the_demo did not run it."""
    from stoker.stack.prefect_home import cold_env
    from stoker.stack.s3server import s3_env

    tmp = tmp_path_factory.mktemp("demo")
    ui_port = free_port()
    hub_port = free_port(exclude=(ui_port,))
    # Cold for real: no server of the caller's, and this Prefect home migrates its own database and registers its
    # block types (no template from make test-services).
    env = cold_env({k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_")})
    env.update(STOKER_HOME=str(tmp / "home"), PREFECT_HOME=str(tmp / "prefect-client"), PREFECT_LOGGING_LEVEL="INFO",
               STOKER_DEMO_PREFECT_PORT=str(ui_port), STOKER_DEMO_HUB_PORT=str(hub_port),
               STOKER_DEMO_S3_PORT=str(free_port(exclude=(ui_port, hub_port))))
    state = {"env": env, "tmp": tmp, "ui": f"http://127.0.0.1:{ui_port}", "ui_port": ui_port, "down": None}
    try:
        state["run"] = run = stoker(["demo"], env, timeout=900)
        if run.returncode == 0:
            hub = re.search(r"^demo: Hub mirror \(olah\) at (\S+)$", run.stdout, re.M)[1]
            s3_url = re.search(r"^demo: S3 \(moto.*\) at (\S+)$", run.stdout, re.M)[1]
            spec = yaml.safe_load(DEMO_SPEC.read_text())  # the spec the demo ran, as `stoker run` takes it
            spec["model"]["endpoint"], spec["storage"]["endpoint_url"] = hub, s3_url
            state.update(hub=hub, s3=s3_url, data=spec, m1=manifest_of(run),
                         # later `stoker` calls: the demo's S3 keys (the demo keeps them in its own process)
                         cli_env={**env, **{k: v for k, v in s3_env(s3_url).items() if k != "AWS_ENDPOINT_URL"}})
        yield state
    finally:
        if state["down"] is None:
            _down(env)


@pytest.fixture
def built(demo):
    run = demo["run"]
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return demo


def test_cold_demo_builds_serves_and_reports(built, tmp_path):
    first, data, m1, ui = built["run"], built["data"], built["m1"], built["ui"]
    env = built["cli_env"]
    assert noise(first.stdout + first.stderr) == []  # the model's generation is logged here too
    assert m1["status"] == "completed"
    assert all(m1["steps"][s]["status"] == "completed" for s in (*HEAVY_STEPS, "deploy", "benchmark"))
    assert not any(m1["steps"][s]["cache_hit"] for s in (*HEAVY_STEPS, "deploy"))
    # The resolved sha is the mirror's git commit.
    from stoker.stack.hub_mirror import repos_dir

    repo = repos_dir(Path(env["STOKER_HOME"]) / "stack") / "models" / DEMO_REPO
    git_sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert m1["model"]["sha"] == git_sha.strip()
    # fp8 really happened: the quantize step checked the export structurally.
    assert m1["steps"]["quantize"]["detail"]["format"] == "fp8"
    # Evaluated on the candidate before it served, against the unquantized build checked against transformers.
    ev = m1["evaluation"]
    assert ev["passed"] and ev["baseline"]["check"]["passed"]
    assert ev["baseline"]["check"]["max_abs_log_prob_diff"] <= ev["baseline"]["check"]["tolerance"]
    assert ev["candidate"]["perplexity"] > 1 and 0 <= ev["candidate"]["agreement"]["token_match_rate"] <= 1
    order = list(m1["steps"])
    assert order.index("benchmark") < order.index("evaluate") < order.index("gate") < order.index("switch")
    assert [lv["concurrency"] for lv in m1["benchmark"]["levels"]] == data["benchmark"]["concurrency"]
    for level in m1["benchmark"]["levels"]:
        assert level["errors"] == 0 and level["requests"] == data["benchmark"]["requests_per_level"]
        assert level["ttft_ms"]["p50"] > 0 and level["output_tokens_per_s"] > 0

    # The demo's own run is on its Prefect server, completed, under the demo's deployment's flow; the UI shows it.
    line = next(x for x in first.stdout.splitlines() if x.startswith("Prefect:"))
    run_id = re.search(rf"{re.escape(ui)}/runs/flow-run/([0-9a-f-]{{36}})", line).group(1)
    assert _get(f"{ui}/api/flow_runs/{run_id}")["state_type"] == "COMPLETED"
    deployment = _get(f"{ui}/api/deployments/name/build_and_deploy/demo")
    assert deployment["work_pool_name"] == "stoker-demo"
    assert "spec" in deployment["parameter_openapi_schema"]["properties"]  # the UI renders it as a form

    # The repository and the manifest are in S3; the manifest there equals the local one.
    s3 = boto3.client("s3", endpoint_url=built["s3"], region_name="us-east-1",
                      aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
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
    assert [lv["errors"] for lv in m1["benchmark"]["adapters"]["demo-lora"]] == [0] * len(
        data["benchmark"]["concurrency"])
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


def test_a_form_run_in_the_ui_is_a_rerun_of_cache_hits(built, tmp_path):
    assert (reason := prefect_ui.missing()) is None, reason  # a missing browser fails: infra/test-deps.sh installs it
    ui, m1, env = built["ui"], built["m1"], built["cli_env"]
    deployment = _get(f"{ui}/api/deployments/name/build_and_deploy/demo")
    demo_run = re.search(r"/runs/flow-run/([0-9a-f-]{36})", built["run"].stdout).group(1)

    def new_runs() -> list[str]:
        runs = _post(f"{ui}/api/flow_runs/filter", {"flow_runs": {"deployment_id": {"any_": [deployment["id"]]}}})
        return [r["name"] for r in runs if r["id"] != demo_run]

    worker_log = Path(env["STOKER_HOME"]) / "stack" / "logs" / "prefect-worker-stoker-demo.log"
    logged = worker_log.stat().st_size
    driver = prefect_ui.browser()
    try:
        name = prefect_ui.submit_custom_run(driver, ui, deployment["id"], new_runs)  # defaults: the demo spec
        url = prefect_ui.open_run(driver, name)
        assert prefect_ui.wait_final_state(driver, timeout_s=600) == "completed", url
        artifacts = prefect_ui.open_tab(driver, "Artifacts")
        assert "stoker-demo-report" in artifacts and "stoker-demo-benchmark" in artifacts, artifacts[-2000:]
    finally:
        driver.quit()
    # The browser's run is a real run of the deployment, executed by the demo's process worker in a new process.
    form_run = _get(url.replace("/runs/flow-run/", "/api/flow_runs/"))
    assert form_run["deployment_id"] == deployment["id"] and form_run["state_type"] == "COMPLETED"
    # Its logs (the worker's, which carries the run's process) are clean.
    with worker_log.open(errors="replace") as f:
        f.seek(logged)
        assert noise(f.read()) == []

    # The cache survived the demo's process: the form run hit every cached step of the same spec.
    m2 = json.loads(sorted((Path(env["STOKER_HOME"]) / "runs").glob("*/manifest.json"))[-1].read_text())
    assert m2["run_id"] != m1["run_id"] and m2["status"] == "completed"
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
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(built["data"]))
    plan = stoker(["plan", str(path)], {**env, "PREFECT_API_URL": f"{ui}/api"}, timeout=300)
    assert plan.returncode == 0, plan.stderr
    rows = {line.split()[0]: line.split()[1] for line in plan.stdout.splitlines()[2:]}
    assert rows == {"fetch": "hit", "adapters": "checked", "quantize": "hit", "build": "hit", "package": "hit",
                    "upload": "hit", "deploy": "hit", "benchmark": "hit", "evaluate": "runs"}, plan.stdout


def test_a_damaged_checkpoint_fails_the_gate_and_the_first_build_still_answers(built, tmp_path):
    """A checkpoint with damaged scales (well-formed, wrong numbers) fails the evaluation gate in one line; the
    candidate never serves and the first build still answers at the same address. Its evaluation runs an
    lm-evaluation-harness task through the candidate's endpoint too (the demo spec has none)."""
    from eval_faults import publish_damaged

    from stoker.cache.keys import quantize_key
    from stoker.spec.load import load_spec

    from stoker.stack.prefect_home import cold_env

    # `stoker run` with its own temporary Prefect API in a new, cold Prefect home (no template): that API's cold
    # start is this module's only one (the demo reports to its server).
    m1, env = built["m1"], {**cold_env(built["cli_env"]), "PREFECT_HOME": str(tmp_path / "prefect")}
    data = json.loads(json.dumps(built["data"]))
    data["quantization"]["calibration"]["samples"] = 15  # a new quantize key; its cache entry is the damage
    data.pop("adapters")  # the gate under test is the base model's; the adapter was served and scored above
    data["benchmark"].update({"concurrency": [1, 2], "requests_per_level": 4, "output_tokens": 16})  # not under test
    data["evaluation"] = {"lm_eval": {"task": "stoker_cloze", "limit": 8}}  # lm-eval through the endpoint too
    damaged_spec = tmp_path / "damaged.yaml"
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
    task = m3["evaluation"]["candidate"]["task"]
    assert task["task"] == "stoker_cloze" and task["n"] == 8 and 0 <= task["score"] <= 1
    with urllib.request.urlopen(urllib.request.Request(
            f"{m1['endpoint']['http']}/v2/models/ensemble/generate", data=json.dumps(
                {"text_input": "The quick brown fox", "max_tokens": 4}).encode()), timeout=60) as resp:
        assert "text_output" in json.loads(resp.read())


def test_down_stops_the_demo(demo):
    demo["down"] = down = _down(demo["env"])
    assert down.returncode == 0, down.stderr
    assert "stopped prefect-server" in down.stdout, down.stdout
    assert not port_open(demo["ui_port"])
