"""Load generation pieces without a server: shares, arrivals, workload lengths and prompt files, CLI input errors."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest

from stoker.bench.errors import InvalidBenchmarkConfig
from stoker.bench.load import arrival_gaps, share
from stoker.bench.workload import PromptFileError, load_prompt_file, make_prompts
from stoker.cli import main


def test_shares_add_up() -> None:
    for total in (0, 1, 5, 16, 17):
        for workers in (1, 2, 3, 4):
            parts = [share(total, w, workers) for w in range(workers)]
            assert sum(parts) == total and max(parts) - min(parts) <= 1


def test_arrivals_poisson_and_constant() -> None:
    gaps = arrival_gaps(50.0, "poisson", random.Random(1))
    sample = [gaps() for _ in range(20000)]
    assert statistics.fmean(sample) == pytest.approx(0.02, rel=0.03)
    assert statistics.pstdev(sample) == pytest.approx(0.02, rel=0.05)  # exponential: std = mean
    again = arrival_gaps(50.0, "poisson", random.Random(1))
    assert [again() for _ in range(5)] == sample[:5]  # seeded
    const = arrival_gaps(50.0, "constant", random.Random(1))
    assert {const() for _ in range(10)} == {0.02}


def test_lengths_with_stddev_are_seeded_and_spread() -> None:
    prompts = make_prompts(400, 64, seed=5, input_stddev=8, output_tokens=32, output_stddev=4)
    isl = [p.input_tokens for p in prompts]
    osl = [p.output_tokens for p in prompts]
    assert all(len(p.text.split()) == p.input_tokens for p in prompts)
    assert statistics.fmean(isl) == pytest.approx(64, abs=1.5) and statistics.pstdev(isl) == pytest.approx(8, rel=0.15)
    assert statistics.fmean(osl) == pytest.approx(32, abs=1.0) and statistics.pstdev(osl) == pytest.approx(4, rel=0.15)
    assert prompts == make_prompts(400, 64, seed=5, input_stddev=8, output_tokens=32, output_stddev=4)
    # stddev 0 keeps exactly the prompts the workload always produced
    assert [p.text for p in make_prompts(3, 10, seed=1)] == [p.text for p in make_prompts(3, 10, seed=1, output_tokens=7)]


def test_prompt_file(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('{"text": "one two three"}\n\n{"text_input": "four five", "output_tokens": 9}\n')
    prompts = load_prompt_file(f)
    assert [(p.text, p.input_tokens, p.output_tokens) for p in prompts] == [
        ("one two three", 3, None), ("four five", 2, 9)]
    f.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(PromptFileError, match=r"p.jsonl line 2: not JSON"):
        load_prompt_file(f)
    f.write_text('{"prompt": "x"}\n')
    with pytest.raises(PromptFileError, match=r"line 1: needs a non-empty \"text\""):
        load_prompt_file(f)
    f.write_text("\n")
    with pytest.raises(PromptFileError, match="holds no prompts"):
        load_prompt_file(f)
    assert issubclass(PromptFileError, InvalidBenchmarkConfig)


@pytest.mark.parametrize(
    ("args", "cause"),
    [
        (["--requests", "0"], "zero requests: requests per level must be >= 1, got 0"),
        (["--concurrency", "0"], "concurrency must be >= 1, got 0"),
        (["--request-rate", "0"], "request rate must be > 0 requests/s, got 0.0"),
        (["--concurrency", "2", "--request-rate", "3"], "give --concurrency or --request-rate, not both"),
        (["--prompt-file", "/nonexistent.jsonl"], "prompt file /nonexistent.jsonl: No such file or directory"),
    ],
)
def test_bench_command_refuses_bad_input_in_one_line(args: list[str], cause: str, tmp_path: Path, capsys) -> None:
    # Refused before any connection: the URL need not answer.
    code = main(["bench", "--url", "127.0.0.1:9", "--out", str(tmp_path / "o"), "--quiet", *args])
    err = capsys.readouterr().err.strip()
    assert code == 1 and "\n" not in err and cause in err
