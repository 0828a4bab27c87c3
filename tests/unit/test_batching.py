"""In-flight batching of the reference runtime (stoker/runtime/batch.py) on real tiny models, in process.

Sequences decoded together must give what each gives alone (`generate`), and greedy ids must equal
transformers' greedy `generate`, for every architecture the reference path serves.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_runtime import CONFIGS, NO_END, PROMPT, hf_greedy, hf_model, write_artifact

from stoker.runtime.batch import Batcher
from stoker.runtime.generate import Record, generate
from stoker.runtime.model import load_model

ARCHS = {**CONFIGS, "phi3": lambda **kw: transformers.Phi3Config(pad_token_id=0, **kw)}
# Different lengths, so the sequences of one step sit at different positions of their caches.
PROMPTS = [PROMPT, PROMPT[:5], [3, 9, 27, 81, 243, 729, 100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 17, 18, 19],
           PROMPT[::-1], [5] * 7]
BUDGETS = [24, 9, 24, 17, 24]  # some end early, so others join a running batch


def _model(arch: str, root: Path, **artifact):
    CONFIGS.setdefault(arch, ARCHS[arch])  # hf_model looks the architecture up there
    ref = hf_model(arch)
    return ref, load_model(write_artifact(ref, root, **artifact), num_threads=2)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _model("llama", tmp_path_factory.mktemp("llama"))


def _run(batcher: Batcher, requests: list[tuple[list[int], int, dict]]) -> list[list[int]]:
    streams = [batcher.submit(p, n, kw.pop("end_id", NO_END), **kw) for p, n, kw in requests]
    if not batcher._thread.is_alive():
        batcher.start()
    return [list(s) for s in streams]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_concurrent_greedy_equals_alone_and_transformers(arch, tmp_path: Path) -> None:
    """Qwen2's biases, Mistral's sliding window (8 < the sequences), Phi-3's fused projections, batched."""
    ref, model = _model(arch, tmp_path)
    expected = [hf_greedy(ref, p, n) for p, n in zip(PROMPTS, BUDGETS)]
    alone = [list(generate(model, p, n, end_id=NO_END)) for p, n in zip(PROMPTS, BUDGETS)]
    assert alone == expected
    batcher = Batcher(model, max_batch=3)
    try:
        got = _run(batcher, [(p, n, {}) for p, n in zip(PROMPTS, BUDGETS)])
    finally:
        batcher.stop()
    assert got == expected
    assert batcher.largest_step == 3, "the sequences were never decoded together"


def test_batched_step_logits_equal_each_sequence_alone(llama) -> None:
    _, model = llama
    assert model.enable_batching()
    caches, tokens = [], []
    for prompt in PROMPTS:
        caches.append(model.new_cache())
        tokens.append(int(model.forward(prompt, caches[-1])[-1].argmax()))
    alone = []
    for prompt, token in zip(PROMPTS, tokens):
        cache = model.new_cache()
        model.forward(prompt, cache)
        alone.append(model.forward([token], cache)[-1])
    batched = model.forward_batch(tokens, caches)
    assert batched.shape == (len(PROMPTS), model.vocab_size)
    assert (batched - torch.stack(alone)).abs().max().item() < 1e-4
    assert [c.get_seq_length() for c in caches] == [len(p) + 1 for p in PROMPTS]


def test_kv_cache_rounding_batched_equals_alone(llama, tmp_path: Path) -> None:
    ref, model = llama
    cache = model.new_cache()
    model.forward(PROMPT, cache)
    scales = {str(i): {"k": layer.keys.abs().max().item() / 16, "v": layer.values.abs().max().item() / 16}
              for i, layer in enumerate(cache.layers)}
    quantized = load_model(write_artifact(ref, tmp_path, quantization={
        "format": "none", "kv_cache_dtype": "int8", "kv_scales": scales}))
    alone = [list(generate(quantized, p, n, end_id=NO_END)) for p, n in zip(PROMPTS, BUDGETS)]
    batcher = Batcher(quantized, max_batch=4)
    try:
        assert _run(batcher, [(p, n, {}) for p, n in zip(PROMPTS, BUDGETS)]) == alone
    finally:
        batcher.stop()


def test_sampling_stop_words_end_id_and_log_probs_as_alone(llama) -> None:
    _, model = llama
    greedy = list(generate(model, PROMPT, 16, end_id=NO_END))
    end = next(t for i, t in enumerate(greedy) if i >= 3 and t not in greedy[:i])
    first = list(generate(model, PROMPT[:6], 1, end_id=NO_END))
    requests = [
        (PROMPT, 16, {"end_id": end}),
        (PROMPT[:6], 20, {"stop_words": [first]}),
        (PROMPT, 20, {"temperature": 0.8, "top_k": 50, "top_p": 0.9, "seed": 7}),
        (PROMPT[::-1], 20, {"temperature": 1.2, "seed": 3, "repetition_penalty": 1.3, "min_new_tokens": 5}),
    ]

    def alone(prompt, n, kw):
        kw = dict(kw)
        record = Record()
        return list(generate(model, prompt, n, kw.pop("end_id", NO_END), record=record, **kw)), record.log_probs

    expected = [alone(*r) for r in requests]
    assert len(expected[0][0]) == greedy.index(end) and len(expected[1][0]) == 1  # end id / stop word took effect
    records = [Record() for _ in requests]
    batcher = Batcher(model, max_batch=4)
    try:
        got = _run(batcher, [(p, n, {**kw, "record": r}) for (p, n, kw), r in zip(requests, records)])
    finally:
        batcher.stop()
    assert got == [tokens for tokens, _ in expected]
    for record, (_, log_probs) in zip(records, expected):
        assert torch.allclose(torch.tensor(record.log_probs), torch.tensor(log_probs), atol=1e-4)


def test_cancelling_one_leaves_the_others_unchanged(llama) -> None:
    _, model = llama
    alone = [list(generate(model, p, 40, end_id=NO_END)) for p in PROMPTS[:3]]
    batcher = Batcher(model, max_batch=3)
    try:
        streams = [batcher.submit(p, n, NO_END) for p, n in zip(PROMPTS[:3], (40, 200, 40))]
        batcher.start()
        cancelled = []
        for token in streams[1]:
            cancelled.append(token)
            if len(cancelled) == 3:
                # No slot frees before the others' 40 tokens: this one waits, and is cancelled while it waits.
                waiting = batcher.submit(PROMPT, 8, NO_END)
                waiting.cancel()
                break
        streams[1].cancel()  # (leaving the iterator early already did)
        got = [list(streams[0]), list(streams[2])]
        assert list(waiting) == [] and waiting.decoding.cache is None  # never prefilled
    finally:
        batcher.stop()
    assert got == [alone[0], alone[2]]
    assert streams[1].finished and streams[1].decoding.step < 200
    assert cancelled == list(generate(model, PROMPTS[1], 3, end_id=NO_END))


def test_more_requests_than_the_limit_wait_their_turn(llama) -> None:
    _, model = llama
    alone = [list(generate(model, p, n, end_id=NO_END)) for p, n in zip(PROMPTS, BUDGETS)]
    batcher = Batcher(model, max_batch=2)
    try:
        streams = [batcher.submit(p, n, NO_END) for p, n in zip(PROMPTS, BUDGETS)]
        assert batcher.counts() == (0, 5)
        batcher.start()
        assert [list(s) for s in streams] == alone
    finally:
        batcher.stop()
    assert batcher.largest_step == 2
    assert batcher.counts() == (0, 0)


def test_limit_one_runs_requests_one_after_another(llama) -> None:
    _, model = llama
    alone = [list(generate(model, p, n, end_id=NO_END)) for p, n in zip(PROMPTS[:3], BUDGETS[:3])]
    batcher = Batcher(model, max_batch=1)
    try:
        assert _run(batcher, [(p, n, {}) for p, n in zip(PROMPTS[:3], BUDGETS[:3])]) == alone
    finally:
        batcher.stop()
    assert batcher.largest_step == 1


def test_an_over_long_request_is_refused_alone(llama) -> None:
    _, model = llama
    alone = [list(generate(model, p, 30, end_id=NO_END)) for p in PROMPTS[:2]]
    batcher = Batcher(model, max_batch=4)
    try:
        streams = [batcher.submit(p, 30, NO_END) for p in PROMPTS[:2]]
        batcher.start()
        tokens = iter(streams[0])
        first = next(tokens)
        with pytest.raises(ValueError, match="max_position_embeddings"):
            batcher.submit(list(range(model.max_positions)), 4, NO_END)
        with pytest.raises(ValueError, match="input_ids must lie"):
            batcher.submit([model.vocab_size], 4, NO_END)
        got = [[first, *tokens], list(streams[1])]
    finally:
        batcher.stop()
    assert got == alone
    assert batcher.counts() == (0, 0)


def test_without_batched_passes_steps_run_one_after_another(llama) -> None:
    """A model whose attention cannot be swapped is still scheduled in flight, its steps one sequence at a time."""
    _, model = llama
    alone = [list(generate(model, p, n, end_id=NO_END)) for p, n in zip(PROMPTS[:3], BUDGETS[:3])]
    batcher = Batcher(model, max_batch=3)
    batcher.batched = False
    try:
        assert _run(batcher, [(p, n, {}) for p, n in zip(PROMPTS[:3], BUDGETS[:3])]) == alone
    finally:
        batcher.stop()
    assert batcher.largest_step == 3


def test_stop_ends_waiting_and_running_sequences(llama) -> None:
    _, model = llama
    batcher = Batcher(model, max_batch=1)
    streams = [batcher.submit(PROMPT, 200, NO_END) for _ in range(2)]
    batcher.start()
    while batcher.steps == 0:
        time.sleep(0.001)
    batcher.stop(error=RuntimeError("shutting down"))
    for stream in streams:
        with pytest.raises(RuntimeError, match="shutting down"):
            list(stream)
    with pytest.raises(RuntimeError, match="stopped"):
        batcher.submit(PROMPT, 4, NO_END)
