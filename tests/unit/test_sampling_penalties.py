"""Presence / frequency penalties and the embedding bias (OpenAI's logit_bias) in the reference runtime, against an
independent computation with torch over the model's own full-forward logits (TensorRT-LLM's kernel semantics:
stoker/runtime/generate.py's docstring)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_runtime import NO_END, PROMPT, hf_model, our_logits, write_artifact

from stoker.runtime.generate import Record, generate
from stoker.runtime.model import load_model

TOL = 1e-4


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    return load_model(write_artifact(hf_model(), tmp_path_factory.mktemp("artifact")), num_threads=2)


def expected_rows(model, prompt: list[int], generated: list[int], presence: float, frequency: float,
                  bias: torch.Tensor | None, temperature: float | None) -> list[torch.Tensor]:
    """Per generated token, the log-softmax row it was chosen from, computed afresh: the full forward's logits of
    everything before it, plus the bias, over the temperature (None: greedy), less the penalties over the counts of
    the prompt and the tokens generated so far."""
    logits = our_logits(model, prompt + generated)  # row j: the logits after token j
    rows = []
    for i in range(len(generated)):
        z = logits[len(prompt) - 1 + i].double()
        if bias is not None:
            z = z + bias.double()
        if temperature is not None:
            z = z / temperature
        counts = torch.bincount(torch.tensor(prompt + generated[:i]), minlength=model.vocab_size).double()
        z = z - presence * (counts > 0).double() - frequency * counts
        rows.append(torch.log_softmax(z, dim=-1))
    return rows


def test_greedy_penalties_change_the_logits_exactly_as_defined(ours) -> None:
    record = Record()
    got = list(generate(ours, PROMPT, 12, end_id=NO_END, presence_penalty=0.7, frequency_penalty=0.4, record=record))
    rows = expected_rows(ours, PROMPT, got, 0.7, 0.4, None, None)
    assert got == [int(torch.argmax(r)) for r in rows]
    assert record.log_probs == pytest.approx([float(r[t]) for r, t in zip(rows, got)], abs=TOL)
    # The penalties matter: they change the greedy output of this prompt (42 repeats in it).
    assert got != list(generate(ours, PROMPT, 12, end_id=NO_END))


def test_sampled_penalties_come_after_the_temperature(ours) -> None:
    bias = torch.linspace(-1.0, 1.0, ours.vocab_size)
    record = Record()
    got = list(generate(ours, PROMPT, 10, end_id=NO_END, temperature=0.7, top_k=0, seed=3, presence_penalty=-0.5,
                        frequency_penalty=1.2, embedding_bias=bias, record=record))
    rows = expected_rows(ours, PROMPT, got, -0.5, 1.2, bias, 0.7)
    assert record.log_probs == pytest.approx([float(r[t]) for r, t in zip(rows, got)], abs=TOL)


def test_seed_reproduces_a_penalised_sample(ours) -> None:
    kwargs = dict(end_id=NO_END, temperature=1.0, top_k=0, presence_penalty=0.5, frequency_penalty=0.5)
    first = list(generate(ours, PROMPT, 12, seed=11, **kwargs))
    assert list(generate(ours, PROMPT, 12, seed=11, **kwargs)) == first
    assert any(list(generate(ours, PROMPT, 12, seed=s, **kwargs)) != first for s in (12, 13, 14))


def test_bias_minus_100_bans_and_plus_100_forces_a_token(ours) -> None:
    plain = list(generate(ours, PROMPT, 8, end_id=NO_END))
    banned = torch.zeros(ours.vocab_size)
    banned[plain[0]] = -100.0
    got = list(generate(ours, PROMPT, 8, end_id=NO_END, embedding_bias=banned))
    assert plain[0] not in got
    forced = torch.zeros(ours.vocab_size)
    forced[777] = 100.0
    assert list(generate(ours, PROMPT, 8, end_id=NO_END, embedding_bias=forced)) == [777] * 8
    sampled = generate(ours, PROMPT, 8, end_id=NO_END, temperature=1.0, top_k=0, seed=1, embedding_bias=forced)
    assert list(sampled) == [777] * 8


def test_off_values_leave_greedy_output_as_it_was(ours) -> None:
    plain_record, off_record = Record(), Record()
    plain = list(generate(ours, PROMPT, 12, end_id=NO_END, record=plain_record))
    off = list(generate(ours, PROMPT, 12, end_id=NO_END, presence_penalty=0.0, frequency_penalty=0.0,
                        embedding_bias=torch.zeros(ours.vocab_size), record=off_record))
    assert off == plain and off_record.log_probs == plain_record.log_probs


@pytest.mark.parametrize("kwargs, message", [
    ({"embedding_bias": [0.0] * 5}, "embedding_bias has 5 values"),
    ({"embedding_bias": [float("nan")] * 2048}, "not finite"),
    ({"presence_penalty": float("inf")}, "presence_penalty must be finite"),
])
def test_invalid_bias_or_penalty_fails_before_compute(ours, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        generate(ours, PROMPT, 4, end_id=NO_END, **kwargs)
