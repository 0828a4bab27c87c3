"""`stoker bench --protocol openai` against stoker's real OpenAI service (`python -m stoker.openai_api`, as a
deployment runs it) in front of the real tritonserver serving the tiny Llama (the reference build), as in
test_openai_served.py.

Exact output lengths need the service's `min_tokens` (random weights may sample the end id early): with
--ignore-eos every request must generate exactly max_tokens ids (the service's usage), and the bench's own count
(the tokenizer over the streamed text) must equal the tokenizer's count of the same greedy answer asked for in
one piece.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest
from operate_helpers import stoker

pytestmark = [pytest.mark.triton, pytest.mark.slow]

pytest.importorskip("pytriton")
pytest.importorskip("transformers")
from tokenizers import Tokenizer

from grpc_stream import serve_checkpoint
from openai_process import openai_service

from stoker.bench.workload import make_prompts
from stoker.stack.services import free_port
from stoker.workers.tinymodel import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"
REQUESTS, CONCURRENCY, OSL = 8, 2, 12


@pytest.fixture(scope="module")
def openai_url(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-openai")
    make_tiny_model(root / "checkpoint", seed=0)
    with serve_checkpoint(root / "checkpoint", root) as (server, artifact), \
            openai_service(MODEL, server.grpc_url, artifact) as (base, _service):
        yield base, artifact / "tokenizer.json"


def _bench(*args: str) -> subprocess.CompletedProcess:
    return stoker(["bench", *args], env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)


def test_bench_over_openai_counts_every_request_and_token(openai_url, tmp_path):
    base, tokenizer = openai_url
    prompts = make_prompts(4, 16, seed=0, tokenizer_json=tokenizer, output_tokens=OSL)
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"text": p.text, "output_tokens": OSL}) + "\n" for p in prompts))
    out = tmp_path / "bench"
    # The protocol comes from the URL (…/v1); greedy, so each prompt's answer is known below.
    run = _bench("--url", base, "--model", MODEL, "--prompt-file", str(prompt_file), "--tokenizer", str(tokenizer),
                 "--ignore-eos", "--output-tokens", str(OSL), "--extra-input", "temperature=0",
                 "--concurrency", str(CONCURRENCY), "--requests", str(REQUESTS), "--warmup", "2", "--out", str(out),
                 "--quiet")
    assert run.returncode == 0, run.stderr
    summary = json.loads((out / "summary.json").read_text())
    level = summary["levels"][0]
    assert summary["workload"]["protocol"] == "openai"
    assert (level["requests"], level["completed"], level["errors"]) == (REQUESTS, REQUESTS, 0)
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert len(records) == REQUESTS and all(r["ok"] for r in records)
    # The model generated exactly what was asked (min_tokens through the service) ...
    assert [r["reported_output_tokens"] for r in records] == [OSL] * REQUESTS
    # ... and the bench counted the streamed text as the tokenizer counts the same answer asked for in one piece.
    tok = Tokenizer.from_file(str(tokenizer))
    expected = []
    for prompt in prompts:
        whole = httpx.post(f"{base}/completions", timeout=60, json={
            "model": MODEL, "prompt": prompt.text, "max_tokens": OSL, "min_tokens": OSL, "temperature": 0}).json()
        assert whole["usage"]["completion_tokens"] == OSL
        expected.append(len(tok.encode(whole["choices"][0]["text"], add_special_tokens=False).ids))
    assert [r["output_tokens"] for r in records] == [expected[r["request_id"] % len(prompts)] for r in records]
    assert all(r["first_response_s"] is not None and r["end_s"] >= r["first_response_s"] for r in records)


def test_preflight_errors_are_one_line(openai_url, tmp_path):
    base, tokenizer = openai_url
    missing = _bench("--protocol", "openai", "--url", base, "--model", "gpt-4o", "--tokenizer", str(tokenizer),
                     "--requests", "1", "--out", str(tmp_path / "a"), "--quiet")
    assert missing.returncode == 1
    assert missing.stderr.strip() == (f"stoker: error: model 'gpt-4o' is not served at {base} "
                                      f"(models: {MODEL}; give --model)")
    gone = _bench("--protocol", "openai", "--url", f"http://127.0.0.1:{free_port()}/v1", "--model", MODEL,
                  "--tokenizer", str(tokenizer), "--requests", "1", "--out", str(tmp_path / "b"), "--quiet")
    assert gone.returncode == 1 and "is unreachable" in gone.stderr and len(gone.stderr.strip().splitlines()) == 1


def test_a_schema_workload_measures_the_constraints_cost_side_by_side(openai_url, tmp_path):
    """`--json-schema`: every request carries the schema (a schema the server refuses fails every one of them with
    its 400), and the same workload runs again without it, the cost printed per level."""
    base, tokenizer = openai_url
    schema = tmp_path / "answer.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"answer": {"type": "string", "maxLength": 8}},
                                  "required": ["answer"]}))
    common = ("--url", base, "--model", MODEL, "--tokenizer", str(tokenizer), "--output-tokens", "16",
              "--extra-input", "temperature=0", "--concurrency", "1", "--requests", "3", "--warmup", "1", "--quiet")
    out = tmp_path / "bench"
    run = _bench(*common, "--json-schema", str(schema), "--out", str(out))
    assert run.returncode == 0, run.stderr
    constrained = json.loads((out / "summary.json").read_text())
    free = json.loads((out / "unconstrained" / "summary.json").read_text())
    assert constrained["workload"]["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "answer", "schema": json.loads(schema.read_text()),
                                               "strict": True}}
    assert "response_format" not in free["workload"]
    for s in (constrained, free):
        assert [(lv["requests"], lv["completed"], lv["errors"]) for lv in s["levels"]] == [(3, 3, 0)]
    cost = [line for line in run.stdout.splitlines() if "x the free output tok/s" in line]
    assert len(cost) == 1 and cost[0].startswith("concurrency 1: constrained "), run.stdout

    loops = tmp_path / "loops.json"  # a $ref to itself: refused by the service before any token is generated
    loops.write_text(json.dumps({"$ref": "#"}))
    bad = _bench(*common, "--warmup", "0", "--json-schema", str(loops), "--out", str(tmp_path / "bad"))
    # The first request is the preflight's: the service's 400 is the command's one-line error.
    assert bad.returncode == 1 and bad.stderr.startswith("stoker: error: first request to model 'tiny' failed: "
                                                         "HTTP 400: Invalid schema for response_format 'loops'")
    assert len(bad.stderr.strip().splitlines()) == 1


def test_a_schema_workload_refuses_bad_settings_in_one_line(openai_url, tmp_path):
    base, tokenizer = openai_url
    cases = {
        ("--json-schema", str(tmp_path / "none.json")): "--json-schema",
        ("--json-schema", str(ROOT / "README.md")): "not JSON",
        ("--json-schema", str(ROOT / "pyproject.toml"), "--protocol", "grpc"): "not JSON",
        ("--response-format", "json_object", "--protocol", "http"): "use --protocol openai",
    }
    for extra, words in cases.items():
        run = _bench("--url", base, "--tokenizer", str(tokenizer), "--requests", "1", "--quiet",
                     "--out", str(tmp_path / "x"), *extra)
        assert run.returncode == 1 and len(run.stderr.strip().splitlines()) == 1 and words in run.stderr, (extra,
                                                                                                          run.stderr)
    assert not (tmp_path / "x").exists()
