"""What reaches a run's log from child processes and containers (issue 14 item 6: clean logs)."""

from __future__ import annotations

import sys

import pytest
import yaml

from stoker.orchestration.child import run_module
from stoker.demo import DEMO_SPEC
from stoker.errors import ChildProcessFailed
from stoker.deploy.rollout import backend_spec
from stoker.serving.triton_log import shown
from stoker.spec.load import parse_spec
from stoker.workers.quantize import calibration_tokens, text_windows

# ---- Triton's output in the run log: warnings and errors, not its startup story -----------------------


@pytest.mark.parametrize("line", [
    'I1123 14:07:14.466588 1 model_lifecycle.cc:472] "loading: preprocessing:1"',
    'I1123 14:07:26.027529 1 server.cc:604] ',
    "+------------------+------+",
    "| server_version                   | 2.51.0 |",
    "| tensorrt_llm   | 1       | READY  |",
    "",
    # The CPU image is a GPU build of Triton; on a machine without a GPU it always says these.
    'E1123 14:07:12.739470 1 server.cc:241] "CudaDriverHelper has not been initialized."',
    'E1123 14:07:26.027334 1 ensemble_scheduler.cc:1468] "unable to create stream for ensemble: CUDA driver '
    'version is insufficient for CUDA runtime version"',
    "Error: Failed to initialize NVML",
    'W1123 14:07:26.032067 1 metrics.cc:798] "DCGM unable to start: DCGM initialization error"',
    'W1123 14:07:12.737091 1 pinned_memory_manager.cc:273] "Unable to allocate pinned system memory, pinned memory '
    'pool will not be available: CUDA driver version is insufficient for CUDA runtime version"',
    'W1123 14:07:29.331490 1 pinned_memory_manager.cc:170] "failed to allocate pinned system memory: no pinned '
    'memory pool, falling back to non-pinned system memory"',
])
def test_triton_startup_and_cpu_only_lines_stay_in_the_container_log(line):
    assert not shown(line)


@pytest.mark.parametrize("line", [
    'E1123 14:07:14.1 1 model_lifecycle.cc:641] "failed to load \'tensorrt_llm\' version 1: Internal: ValueError"',
    'W1123 14:07:14.1 1 server.cc:251] "failed to enable peer access for some device pairs"',
    "Traceback (most recent call last):",
    "ValueError: weights/model.safetensors: missing tensor lm_head.weight",
])
def test_triton_errors_warnings_and_tracebacks_reach_the_run_log(line):
    assert shown(line)


def test_the_cpu_backend_is_started_without_the_gpu_probes_that_fail_on_cpu():
    spec = parse_spec(yaml.safe_load(DEMO_SPEC.read_text()), "demo")
    backend = backend_spec(spec, "s3://127.0.0.1:9/b/p/model_repository", "d" * 64, {})
    assert backend.extra_args[:2] == ["--allow-gpu-metrics=false", "--pinned-memory-pool-byte-size=0"]


# ---- a worker's result line is returned, not logged ----------------------------------------------------

WORKER = """
import json, sys
print("step one", file=sys.stderr)
if "--fail" in sys.argv:
    print("error: the cause", file=sys.stderr)
    sys.exit(1)
print(json.dumps({"out": "/x", "n": 3}))
"""


@pytest.fixture
def worker_module(tmp_path, monkeypatch):
    (tmp_path / "stoker_fake_worker.py").write_text(WORKER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("STOKER_HEAVY_PYTHON", sys.executable)
    return "stoker_fake_worker"


def test_a_workers_result_is_returned_and_kept_out_of_the_log(worker_module):
    lines: list[str] = []
    assert run_module(worker_module, [], lines.append) == {"out": "/x", "n": 3}
    assert lines == ["step one"]


def test_a_failing_worker_still_names_its_cause(worker_module):
    lines: list[str] = []
    with pytest.raises(ChildProcessFailed, match="error: the cause"):
        run_module(worker_module, ["--fail"], lines.append)
    assert lines == ["step one", "error: the cause"]


def test_a_json_line_that_is_not_last_is_logged(tmp_path, monkeypatch):
    (tmp_path / "stoker_fake_worker2.py").write_text('print(\'{"a": 1}\')\nprint("done")\n')
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    lines: list[str] = []
    assert run_module("stoker_fake_worker2", [], lines.append) is None
    assert lines == ['{"a": 1}', "done"]


# ---- calibration text is tokenized in windows the model can take --------------------------------------


def test_text_windows_rejoin_to_the_text_and_cut_at_line_ends_then_before_spaces():
    text = "one two\nthree four five six\n" + "x" * 25
    pieces = text_windows(text, 10)
    assert "".join(pieces) == text
    assert all(len(p) <= 10 for p in pieces)
    assert pieces[:4] == ["one two\n", "three four", " five six\n", "xxxxxxxxxx"]


class _CharTokenizer:
    """One id per character, with the limit a real tokenizer would warn about."""

    model_max_length = 40

    def __init__(self):
        self.longest = 0

    def __call__(self, text, add_special_tokens=False):
        assert add_special_tokens is False
        self.longest = max(self.longest, len(text))
        return {"input_ids": [ord(c) for c in text]}


def test_calibration_tokens_stay_within_the_models_length_and_lose_nothing():
    tok = _CharTokenizer()
    text = ("The harbour woke before the town did. " * 20 + "\n") * 3
    assert calibration_tokens(tok, text) == [ord(c) for c in text]
    assert tok.longest <= tok.model_max_length // 4
