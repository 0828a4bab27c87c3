"""Log probabilities and context logits of the reference runtime against transformers' own logits."""

from __future__ import annotations


import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_runtime import NO_END, PROMPT, hf_model, write_artifact

from stoker.runtime.generate import Record, generate, token_log_probs
from stoker.runtime.model import load_model

TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    ref = hf_model()
    return ref, load_model(write_artifact(ref, tmp_path_factory.mktemp("artifact")), num_threads=2)


def _hf_logits(ref, ids: list[int]) -> torch.Tensor:
    """transformers' logits for every position of `ids`, one full forward without a cache: [len, vocab]."""
    with torch.no_grad():
        return ref(input_ids=torch.tensor([ids])).logits[0].float()


def test_greedy_log_probs_are_transformers_log_softmax(tiny) -> None:
    ref, ours = tiny
    record = Record()
    tokens = list(generate(ours, PROMPT, 16, end_id=NO_END, record=record))
    logits = _hf_logits(ref, PROMPT + tokens)[len(PROMPT) - 1: -1]  # the logits each token was chosen from
    assert tokens == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), tokens]
    assert len(record.log_probs) == len(tokens) == 16
    assert torch.allclose(torch.tensor(record.log_probs), expected, atol=TOL)
    assert record.cum_log_prob == pytest.approx(float(expected.sum()), abs=16 * TOL)
    assert all(lp <= 0 for lp in record.log_probs)
    assert record.context_logits is None  # not asked for


def test_context_logits_are_transformers_prompt_logits(tiny) -> None:
    ref, ours = tiny
    record = Record(want_log_probs=False, want_context_logits=True)
    list(generate(ours, PROMPT, 2, end_id=NO_END, record=record))
    expected = _hf_logits(ref, PROMPT)
    assert record.context_logits.shape == (len(PROMPT), ours.vocab_size)
    assert torch.allclose(record.context_logits, expected, atol=TOL)
    assert record.log_probs == []
    # Prompt log probabilities, read from the context logits: token t+1 given tokens 0..t.
    prompt_lp = token_log_probs(record.context_logits[:-1], PROMPT[1:])
    want = torch.log_softmax(expected[:-1], -1)[torch.arange(len(PROMPT) - 1), PROMPT[1:]]
    assert torch.allclose(prompt_lp, want, atol=TOL)


def test_sampled_log_probs_follow_the_temperature(tiny) -> None:
    """Sampling: the log prob of the distribution the token was drawn from, log_softmax(logits / T)."""
    ref, ours = tiny
    record = Record()
    tokens = list(generate(ours, PROMPT, 10, end_id=NO_END, temperature=0.7, top_k=50, seed=3, record=record))
    logits = _hf_logits(ref, PROMPT + tokens)[len(PROMPT) - 1: -1] / 0.7
    expected = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), tokens]
    assert torch.allclose(torch.tensor(record.log_probs), expected, atol=TOL)


def test_end_id_is_neither_yielded_nor_scored(tiny) -> None:
    _, ours = tiny
    greedy = list(generate(ours, PROMPT, 12, end_id=NO_END))
    k = 5
    record = Record()
    tokens = list(generate(ours, PROMPT, 12, end_id=greedy[k], record=record))
    assert tokens == greedy[:k] and len(record.log_probs) == k


def test_recording_does_not_change_the_tokens(tiny) -> None:
    _, ours = tiny
    plain = list(generate(ours, PROMPT, 12, end_id=NO_END, temperature=1.0, top_p=0.9, seed=7))
    record = Record(want_context_logits=True)
    assert list(generate(ours, PROMPT, 12, end_id=NO_END, temperature=1.0, top_p=0.9, seed=7, record=record)) == plain


def test_token_log_probs_shape_and_values() -> None:
    logits = torch.tensor([[0.0, 0.0], [2.0, 0.0]])
    got = token_log_probs(logits, [1, 0])
    assert got.shape == (2,)
    assert torch.allclose(got, torch.log(torch.tensor([0.5, 1 / (1 + torch.exp(torch.tensor(-2.0)))])))


def test_top_log_probs_are_transformers_top_k_of_the_same_rows(tiny) -> None:
    """The alternatives behind OpenAI's top_logprobs: the k largest of transformers' log-softmax at each position."""
    ref, ours = tiny
    k = 5
    record = Record(top_log_probs=k)
    tokens = list(generate(ours, PROMPT, 12, end_id=NO_END, record=record))
    assert tokens == list(generate(ours, PROMPT, 12, end_id=NO_END))  # asking for them changes no token
    rows = torch.log_softmax(_hf_logits(ref, PROMPT + tokens)[len(PROMPT) - 1: -1], -1)
    want = torch.topk(rows, k)
    assert len(record.top) == len(record.log_probs) == len(tokens)
    for i, pairs in enumerate(record.top):
        assert [t for t, _ in pairs] == want.indices[i].tolist()
        assert torch.allclose(torch.tensor([v for _, v in pairs]), want.values[i], atol=TOL)
        assert pairs[0] == (tokens[i], pytest.approx(record.log_probs[i], abs=1e-6))  # greedy: the first is chosen


def test_top_log_probs_while_sampling_come_from_the_sampled_distribution(tiny) -> None:
    ref, ours = tiny
    record = Record(top_log_probs=3)
    tokens = list(generate(ours, PROMPT, 6, end_id=NO_END, temperature=0.7, top_p=0.9, seed=5, record=record))
    rows = torch.log_softmax(_hf_logits(ref, PROMPT + tokens)[len(PROMPT) - 1: -1] / 0.7, -1)
    got = torch.tensor([[v for _, v in pairs] for pairs in record.top])
    assert torch.allclose(got, torch.topk(rows, 3).values, atol=TOL)
    assert Record().top == [] and Record().top_log_probs == 0  # off unless asked
