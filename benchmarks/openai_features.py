"""Issue 50's measure: the OpenAI features applications call, on the reference target, side by side in one run.

One tiny Llama (stoker.workers.tinymodel, seed 0: the generator the demo's model comes from; the real reference
build) served by the local tritonserver, the OpenAI service (`python -m stoker.openai_api`, its own process, as in
its container) in front of Triton's gRPC port, asked through the official `openai` client and httpx. Per feature:

- structured outputs (`response_format` json_schema strict, and json_object): requests, share whose text parses
  and validates against the schema (jsonschema), greedy and sampled (a seed per request);
- log probs (completions `logprobs` 5, greedy): requests, tokens compared, and the largest |Δ| of the sampled
  token's and the alternatives' log probs against transformers' log_softmax at the same positions;
- the constraint's cost: output tokens/s per request (after its first token) and TTFT p50, json_schema vs the same
  request without it, at concurrency 1 and 4, the two kinds interleaved round by round so both see the same machine;
- tool calls (`tools` with `tool_choice` "required", with and without parallel calls, and a named function),
  greedy and sampled: requests, share whose every call parses, names a declared function and has arguments valid
  against that function's schema. The tiny Llama has no chat template: it is given openai_process.TOOLS_TEMPLATE
  (the Hermes family's format, written for the tests), as test_openai_features does.

    python benchmarks/openai_features.py --out benchmarks/results/openai_features.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "integration"))

SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "bright": {"type": "boolean"},
        "name": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
    },
    "required": ["colour", "bright", "name", "tags"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "colour", "schema": SCHEMA, "strict": True}}
PROMPTS = ["The quick brown fox", "Name a colour", "Once upon a time", "A list of things:", "JSON:",
           "Hello there", "The weather today", "In 1999,"]
TOKENS = 48


def _p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _streamed(client: httpx.Client, base: str, body: dict) -> tuple[float, int, float]:
    """(TTFT s, completion tokens, decode tokens/s after the first) of one streamed completion."""
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    with client.stream("POST", f"{base}/completions", json={**body, "stream": True,
                                                           "stream_options": {"include_usage": True}}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if event.get("choices") and event["choices"][0].get("text"):
                last = time.perf_counter()
                first = first or last
    rate = (tokens - 1) / (last - first) if tokens > 1 and last > first else float("nan")
    return first - t0, tokens, rate


def _validity(api, model: str, n: int) -> dict:
    import jsonschema

    def an_object(value) -> None:
        if not isinstance(value, dict):
            raise ValueError("not an object")

    out = {}
    for kind, fmt, check in (("json_schema", FORMAT, lambda v: jsonschema.validate(v, SCHEMA)),
                             ("json_object", {"type": "json_object"}, an_object)):
        valid, finishes = 0, {}
        for i in range(n):
            sampled = i % 2 == 1  # half greedy, half sampled with a seed of its own
            r = api.chat.completions.create(
                model=model, messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], max_tokens=200,
                response_format=fmt, temperature=0.9 if sampled else 0, seed=i if sampled else None)
            choice = r.choices[0]
            finishes[choice.finish_reason] = finishes.get(choice.finish_reason, 0) + 1
            try:
                check(json.loads(choice.message.content))
                valid += 1
            except Exception:  # noqa: BLE001 -- any failure to parse or validate counts as invalid
                pass
        out[kind] = {"requests": n, "valid": valid, "share_valid": round(valid / n, 4), "finish_reasons": finishes,
                     "max_tokens": 200}
    return out


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                         "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "set_alarm", "parameters": {
        "type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                         "label": {"type": "string", "maxLength": 12}},
        "required": ["hour"]}}},
]
CHOICES = [("required", True), ("required", False), ({"type": "function", "function": {"name": "set_alarm"}}, True)]


def _tool_calls(api, model: str, n: int) -> dict:
    import jsonschema

    declared = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    valid, calls, finishes = 0, 0, {}
    for i in range(n):
        choice, parallel = CHOICES[i % len(CHOICES)]
        sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 1.0, "seed": i}
        out = api.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], tools=TOOLS,
            tool_choice=choice, parallel_tool_calls=parallel, max_tokens=160, **sampling).choices[0]
        finishes[out.finish_reason] = finishes.get(out.finish_reason, 0) + 1
        try:
            assert out.finish_reason == "tool_calls" and out.message.tool_calls
            for call in out.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), declared[call.function.name])
            if isinstance(choice, dict):
                assert {c.function.name for c in out.message.tool_calls} == {choice["function"]["name"]}
            valid += 1
            calls += len(out.message.tool_calls)
        except Exception:  # noqa: BLE001 -- any call that does not parse, name a tool or validate counts as invalid
            pass
    return {"requests": n, "valid": valid, "share_valid": round(valid / n, 4), "calls_in_valid_answers": calls,
            "finish_reasons": finishes,
            "tool_choices": ["required (parallel)", "required (one call)", "named set_alarm"],
            "goal": "100 % parse and name a declared function"}


def _logprob_error(api, model: str, ckpt: Path, tokenizer, n: int) -> dict:
    import torch
    import transformers

    ref = transformers.LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    worst_sampled = worst_top = 0.0
    tokens_compared = alternatives_compared = mismatched = shared_text = 0
    for i in range(n):
        prompt = tokenizer.encode(PROMPTS[i % len(PROMPTS)]).ids
        got = api.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, logprobs=5,
                                     seed=i).choices[0].logprobs
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(got.tokens),
                               do_sample=False, pad_token_id=0)
            rows = torch.log_softmax(ref(input_ids=out).logits[0, len(prompt) - 1: -1].float(), -1)
        want = out[0, len(prompt):].tolist()
        for pos, (text, value, alts) in enumerate(zip(got.tokens, got.token_logprobs, got.top_logprobs)):
            if pos >= len(want) or tokenizer.decode([want[pos]], skip_special_tokens=False) != text:
                mismatched += 1
                continue
            worst_sampled = max(worst_sampled, abs(value - float(rows[pos, want[pos]])))
            tokens_compared += 1
            top = torch.topk(rows[pos], 5)
            keys = [tokenizer.decode([tid], skip_special_tokens=False) for tid in top.indices.tolist()]
            for key, v in zip(keys, top.values.tolist()):
                # The legacy shape keys alternatives by text: two ids that decode alike (byte pieces read U+FFFD)
                # share one key, so only texts that stand for one id here can be compared.
                if keys.count(key) > 1:
                    shared_text += 1
                    continue
                if key in alts:
                    worst_top = max(worst_top, abs(alts[key] - v))
                    alternatives_compared += 1
    return {"requests": n, "tokens_compared": tokens_compared, "tokens_not_transformers_greedy": mismatched,
            "alternatives_compared": alternatives_compared, "alternatives_sharing_a_text_skipped": shared_text, "max_abs_delta_sampled": worst_sampled,
            "max_abs_delta_alternatives": worst_top, "goal": "<= 1e-4"}


def _cost(base: str, model: str, rounds: int, concurrency: int) -> dict:
    """Interleaved rounds: `concurrency` streams without a constraint, then as many with json_schema (the order
    flips every round)."""
    results = {"free": [], "json_schema": []}
    body = {"model": model, "max_tokens": TOKENS, "temperature": 0}
    with httpx.Client(timeout=120) as client, ThreadPoolExecutor(concurrency) as pool:
        for r in range(rounds):
            for kind in ("free", "json_schema")[:: 1 if r % 2 == 0 else -1]:
                extra = {"response_format": FORMAT} if kind == "json_schema" else {}
                jobs = [pool.submit(_streamed, client, base, {**body, **extra,
                                                              "prompt": PROMPTS[(r + j) % len(PROMPTS)]})
                        for j in range(concurrency)]
                results[kind] += [j.result() for j in jobs]
    summary = {}
    for kind, rows in results.items():
        rates = [rate for _, _, rate in rows if rate == rate]
        summary[kind] = {"requests": len(rows), "ttft_ms_p50": round(_p50([t for t, _, _ in rows]) * 1000, 2),
                         "output_tok_s_p50": round(_p50(rates), 2),
                         "completion_tokens_mean": round(statistics.mean(n for _, n, _ in rows), 1)}
    summary["ratio_tok_s"] = round(summary["json_schema"]["output_tok_s_p50"] / summary["free"]["output_tok_s_p50"],
                                   3)
    summary["goal_ratio_tok_s"] = ">= 0.8"
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--valid", type=int, default=40, help="requests per structured-output kind")
    p.add_argument("--logprob-requests", type=int, default=16)
    p.add_argument("--rounds", type=int, default=20, help="interleaved rounds per concurrency")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "openai_features.json")
    args = p.parse_args()

    import openai
    from tokenizers import Tokenizer

    from openai_process import TOOLS_TEMPLATE, tiny_model_served

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with tiny_model_served(root, chat_template=TOOLS_TEMPLATE) as (_server, artifact, base):
            api = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
            tokenizer = Tokenizer.from_file(str(artifact / "tokenizer.json"))
            api.completions.create(model="tiny", prompt="warm", max_tokens=2, extra_body={"response_format": FORMAT})
            features = {"structured_outputs": _validity(api, "tiny", args.valid),
                        "logprobs": _logprob_error(api, "tiny", root / "ckpt", tokenizer, args.logprob_requests),
                        "tool_calls": _tool_calls(api, "tiny", args.valid)}
            cost = {f"concurrency_{c}": _cost(base, "tiny", args.rounds, c) for c in (1, 4)}
    result = {
        "what": "issue 50's OpenAI features on the reference target: schema-valid share, forced tool calls' valid "
                "share, log-prob error vs transformers, and a json_schema constraint's cost vs the same requests "
                "without it, interleaved",
        "model": "stoker tiny Llama (make_tiny_model seed 0), reference build, local tritonserver 2.51.0, "
                 "OpenAI service process, no proxy",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (CPU; no GPU)", "date": time.strftime("%Y-%m-%d"),
        "schema": SCHEMA, "stream_max_tokens": TOKENS, "features": features, "cost": cost,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
