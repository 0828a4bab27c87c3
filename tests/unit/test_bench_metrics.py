"""Benchmark metrics (exact, hand-computed expectations) and synthetic workload generation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from stoker.bench.metrics import RequestRecord, describe, percentile, summarize
from stoker.bench.workload import Prompt, make_prompts

APPROX = {"rel": 1e-9, "abs": 1e-9}


def _rec(
    rid: int,
    start: float,
    first: float | None,
    end: float | None,
    osl: int,
    isl: int,
    ok: bool = True,
    error: str | None = None,
) -> RequestRecord:
    return RequestRecord(
        request_id=rid,
        concurrency=2,
        start_s=start,
        first_response_s=first,
        end_s=end,
        chunk_times_s=(),
        input_tokens=isl,
        output_tokens=osl,
        ok=ok,
        error=error,
    )


# Five requests at concurrency 2; one failed. Per successful request (ms):
#   r0: TTFT 100, e2e 500, ITL (500-100)/(5-1) = 100
#   r1: TTFT 200, e2e 600, ITL (600-200)/(3-1) = 200
#   r2: TTFT 300, e2e 300, OSL 1 -> no ITL
#   r4: TTFT 100, e2e 300, ITL (300-100)/(4-1) = 66.666...
# duration = last response 1.0 (the failure, observed at 1.0) - first send 0.0 = 1.0 s
RECORDS = [
    _rec(0, 0.0, 0.1, 0.5, osl=5, isl=10),
    _rec(1, 0.0, 0.2, 0.6, osl=3, isl=20),
    _rec(2, 0.5, 0.8, 0.8, osl=1, isl=30),
    _rec(3, 0.6, None, 1.0, osl=0, isl=50, ok=False, error="model said no"),
    _rec(4, 0.6, 0.7, 0.9, osl=4, isl=40),
]


def test_summary_counts_errors_and_throughput() -> None:
    s = summarize(RECORDS, concurrency=2)
    assert (s.concurrency, s.requests, s.completed, s.errors) == (2, 5, 4, 1)
    assert s.duration_s == pytest.approx(1.0, **APPROX)
    assert s.output_tokens_per_s == pytest.approx(13.0, **APPROX)  # 5+3+1+4 tokens over 1 s
    assert s.requests_per_s == pytest.approx(4.0, **APPROX)
    assert s.input_tokens is not None and s.input_tokens.mean == pytest.approx(25.0)  # failed one excluded
    assert s.output_tokens is not None and s.output_tokens.mean == pytest.approx(3.25)


def test_summary_ttft_stats() -> None:
    t = summarize(RECORDS, concurrency=2).ttft_ms
    assert t is not None
    # sorted [100, 100, 200, 300]; population std = sqrt((75²+75²+25²+125²)/4) = sqrt(6875)
    expected = {
        "mean": 175.0,
        "min": 100.0,
        "max": 300.0,
        "std": math.sqrt(6875.0),
        "p50": 150.0,
        "p90": 270.0,
        "p95": 285.0,
        "p99": 297.0,
    }
    for name, value in expected.items():
        assert getattr(t, name) == pytest.approx(value, **APPROX), name


def test_summary_e2e_stats() -> None:
    e = summarize(RECORDS, concurrency=2).e2e_ms
    assert e is not None
    # sorted [300, 300, 500, 600]
    expected = {
        "mean": 425.0,
        "min": 300.0,
        "max": 600.0,
        "std": math.sqrt(16875.0),
        "p50": 400.0,
        "p90": 570.0,
        "p95": 585.0,
        "p99": 597.0,
    }
    for name, value in expected.items():
        assert getattr(e, name) == pytest.approx(value, **APPROX), name


def test_summary_itl_excludes_single_token_requests() -> None:
    i = summarize(RECORDS, concurrency=2).itl_ms
    assert i is not None
    # sorted [200/3, 100, 200]; r2 (OSL 1) and the failed r3 have no ITL
    mean = (200 / 3 + 100 + 200) / 3
    std = math.sqrt(((200 / 3 - mean) ** 2 + (100 - mean) ** 2 + (200 - mean) ** 2) / 3)
    expected = {
        "mean": mean,
        "min": 200 / 3,
        "max": 200.0,
        "std": std,
        "p50": 100.0,
        "p90": 180.0,
        "p95": 190.0,
        "p99": 198.0,
    }
    for name, value in expected.items():
        assert getattr(i, name) == pytest.approx(value, **APPROX), name


def test_stats_match_numpy_defaults() -> None:
    np = pytest.importorskip("numpy")
    values = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    s = describe(values)
    assert s is not None
    assert s.std == pytest.approx(float(np.std(values)), **APPROX)
    for q in (50, 90, 95, 99):
        assert getattr(s, f"p{q}") == pytest.approx(float(np.percentile(values, q)), **APPROX)


def test_percentile_edges() -> None:
    assert percentile([7.0], 99) == 7.0
    assert percentile([1.0, 2.0], 0) == 1.0
    assert percentile([1.0, 2.0], 100) == 2.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_all_failed_level_is_reported_not_dropped() -> None:
    failed = [_rec(i, 0.1 * i, None, 0.1 * i + 0.05, osl=0, isl=8, ok=False, error="timeout") for i in range(3)]
    s = summarize(failed, concurrency=1)
    assert (s.requests, s.completed, s.errors) == (3, 0, 3)
    assert s.ttft_ms is None and s.itl_ms is None and s.e2e_ms is None
    assert s.output_tokens_per_s == 0.0 and s.requests_per_s == 0.0
    assert s.duration_s == pytest.approx(0.25, **APPROX)


def test_empty_level() -> None:
    s = summarize([], concurrency=4)
    assert (s.requests, s.errors, s.duration_s) == (0, 0, 0.0)


def test_to_dict_is_json_ready() -> None:
    d = summarize(RECORDS, concurrency=2).to_dict()
    back = json.loads(json.dumps(d))
    assert back["ttft_ms"]["p50"] == pytest.approx(150.0)
    assert back["errors"] == 1
    assert set(back["itl_ms"]) == {"mean", "min", "max", "std", "p50", "p90", "p95", "p99"}
    assert back["input_tokens"]["mean"] == 25.0 and back["input_tokens"]["min"] == 10.0


# --- workload -------------------------------------------------------------------------------------

CORPUS = """
The river carried small boats past the old mill, where millers ground wheat and barley into flour.
Children counted the boats from the bridge while their parents argued about the price of bread.
A storm came in from the west and the river rose, flooding the lower fields and the quiet road.
Engineers measured the water, wrote numbers in their notebooks, and planned a stronger wall.
"""


@pytest.fixture()
def tokenizer_json(tmp_path: Path) -> Path:
    """A small byte-level BPE tokenizer trained here, so exact counts are checked against a real one."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<s>", "</s>"]
    )
    tok.train_from_iterator(CORPUS.splitlines() * 20, trainer=trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.mark.parametrize("target", [1, 2, 7, 64, 550])
def test_prompts_have_exact_token_counts(tokenizer_json: Path, target: int) -> None:
    tok = Tokenizer.from_file(str(tokenizer_json))
    prompts = make_prompts(5, target, seed=3, tokenizer_json=tokenizer_json)
    assert len(prompts) == 5
    for p in prompts:
        assert p.input_tokens == target
        assert len(tok.encode(p.text, add_special_tokens=False).ids) == target
    assert len({p.text for p in prompts}) == 5  # distinct, so no prompt is a cache hit of another


def test_prompts_reproducible_for_a_seed(tokenizer_json: Path) -> None:
    a = make_prompts(3, 40, seed=11, tokenizer_json=tokenizer_json)
    b = make_prompts(3, 40, seed=11, tokenizer_json=tokenizer_json)
    c = make_prompts(3, 40, seed=12, tokenizer_json=tokenizer_json)
    assert a == b
    assert a != c


def test_prompts_without_tokenizer_count_words() -> None:
    prompts = make_prompts(2, 12, seed=0, tokenizer_json=None)
    assert prompts == make_prompts(2, 12, seed=0, tokenizer_json=None)
    assert all(isinstance(p, Prompt) and p.input_tokens == 12 and len(p.text.split()) == 12 for p in prompts)


def test_prompts_reject_bad_arguments() -> None:
    with pytest.raises(ValueError):
        make_prompts(1, 0, seed=0, tokenizer_json=None)
    with pytest.raises(ValueError):
        make_prompts(-1, 5, seed=0, tokenizer_json=None)
