"""Log probabilities and context logits out of the served reference, against transformers' own logits.

An unquantized tiny Llama (stoker.workers.tinymodel) goes through stoker's build step and repository
assembly and is served by the real tritonserver (python backend, local). TensorRT-LLM's optional
outputs are checked on the tensorrt_llm model and through the ensemble: output_log_probs are the
log-softmax of transformers' logits at the greedy tokens, cum_log_probs their sum, context_logits the
prompt's logits; none of them comes back unless asked for.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = [pytest.mark.triton, pytest.mark.slow]

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("pytriton")
pytest.importorskip("tritonclient.grpc")
from tokenizers import Tokenizer

from grpc_stream import serve_checkpoint, stream_responses

from stoker.workers.tinymodel import make_tiny_model

PROMPT = "The quick brown fox"
BUDGET = 12
TOL = 1e-3
SCORES = ("cum_log_probs", "output_log_probs", "context_logits")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("logprobs")
    ckpt = root / "checkpoint"
    make_tiny_model(ckpt, seed=0)
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    model = transformers.LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with serve_checkpoint(ckpt, root) as (server, _artifact):
        yield {"server": server, "model": model, "prompt_ids": tok.encode(PROMPT).ids}


def _hf_logits(served, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return served["model"](input_ids=torch.tensor([ids])).logits[0].float().numpy()


def _log_softmax(x: np.ndarray) -> np.ndarray:
    return torch.log_softmax(torch.from_numpy(x), dim=-1).numpy()


def _expected_log_probs(served, tokens: list[int]) -> np.ndarray:
    """transformers' log-softmax at each served token, given the prompt and the tokens before it."""
    prompt = served["prompt_ids"]
    logits = _hf_logits(served, prompt + tokens)[len(prompt) - 1: -1]
    assert tokens == logits.argmax(-1).tolist()  # the served tokens are transformers' greedy ones
    return _log_softmax(logits)[np.arange(len(tokens)), tokens]


def _direct(served, streaming: bool, **flags: bool) -> list:
    ids = np.array([served["prompt_ids"]], np.int32)
    inputs = {"input_ids": ids, "input_lengths": np.array([[ids.shape[1]]], np.int32),
              "request_output_len": np.array([[BUDGET]], np.int32), "streaming": np.array([[streaming]]),
              "exclude_input_in_output": np.array([[True]]),
              **{k: np.array([[v]]) for k, v in flags.items()}}
    return stream_responses(served["server"].grpc_url, "tensorrt_llm", inputs)


def _ensemble(served, stream: bool, **flags: bool) -> list:
    inputs = {"text_input": np.array([[PROMPT.encode()]], dtype=object),
              "max_tokens": np.array([[BUDGET]], np.int32), "stream": np.array([[stream]]),
              "exclude_input_in_output": np.array([[True]]),
              **{k: np.array([[v]]) for k, v in flags.items()}}
    return stream_responses(served["server"].grpc_url, "ensemble", inputs)


def _names(result) -> set[str]:
    return {o.name for o in result.get_response().outputs}


def _check_scores(served, tokens: list[int], per_token: np.ndarray, cum: float) -> None:
    assert len(tokens) > 0 and per_token.shape == (len(tokens),)
    np.testing.assert_allclose(per_token, _expected_log_probs(served, tokens), atol=TOL)
    assert cum == pytest.approx(float(per_token.sum()), abs=TOL)


def _check_context(served, context: np.ndarray) -> None:
    prompt = served["prompt_ids"]
    assert context.shape == (1, len(prompt), served["model"].config.vocab_size)
    np.testing.assert_allclose(context[0], _hf_logits(served, prompt), atol=TOL)


def test_tensorrt_llm_returns_log_probs_and_context_logits(served) -> None:
    [result] = _direct(served, False, return_log_probs=True, return_context_logits=True)
    n = int(result.as_numpy("sequence_length")[0, 0])
    tokens = result.as_numpy("output_ids")[0, 0, :n].tolist()
    assert result.as_numpy("output_log_probs").shape == (1, 1, n)
    assert result.as_numpy("cum_log_probs").shape == (1, 1)
    _check_scores(served, tokens, result.as_numpy("output_log_probs")[0, 0], float(result.as_numpy("cum_log_probs")[0, 0]))
    _check_context(served, result.as_numpy("context_logits"))


def test_streaming_carries_each_tokens_log_prob(served) -> None:
    out = _direct(served, True, return_log_probs=True, return_context_logits=True)
    tokens = [int(r.as_numpy("output_ids")[0, 0, 0]) for r in out]
    per_token = np.array([r.as_numpy("output_log_probs")[0, 0, 0] for r in out])
    assert all(r.as_numpy("output_log_probs").shape == (1, 1, 1) for r in out)
    running = [float(r.as_numpy("cum_log_probs")[0, 0]) for r in out]
    np.testing.assert_allclose(running, np.cumsum(per_token), atol=TOL)  # cum_log_probs so far, per response
    _check_scores(served, tokens, per_token, running[-1])
    assert "context_logits" in _names(out[0]) and all("context_logits" not in _names(r) for r in out[1:])
    _check_context(served, out[0].as_numpy("context_logits"))


@pytest.mark.parametrize("streaming", [False, True])
def test_nothing_extra_unless_asked(served, streaming) -> None:
    for result in _direct(served, streaming) + _direct(served, streaming, return_log_probs=False,
                                                       return_context_logits=False):
        assert _names(result) == {"output_ids", "sequence_length"}
    for result in _ensemble(served, streaming):
        assert _names(result) == {"text_output"}


def test_only_what_was_asked(served) -> None:
    [logits_only] = _direct(served, False, return_context_logits=True)
    assert _names(logits_only) == {"output_ids", "sequence_length", "context_logits"}
    [probs_only] = _ensemble(served, False, return_log_probs=True)
    assert _names(probs_only) == {"text_output", "cum_log_probs", "output_log_probs"}


def test_ensemble_passes_them_through(served) -> None:
    [direct] = _direct(served, False)
    n = int(direct.as_numpy("sequence_length")[0, 0])
    tokens = direct.as_numpy("output_ids")[0, 0, :n].tolist()
    [result] = _ensemble(served, False, return_log_probs=True, return_context_logits=True)
    assert _names(result) == {"text_output", *SCORES}
    assert result.as_numpy("output_log_probs").shape == (1, 1, n)
    _check_scores(served, tokens, result.as_numpy("output_log_probs")[0, 0], float(result.as_numpy("cum_log_probs")[0, 0]))
    _check_context(served, result.as_numpy("context_logits"))


def test_ensemble_streams_them(served) -> None:
    [direct] = _direct(served, False)
    n = int(direct.as_numpy("sequence_length")[0, 0])
    tokens = direct.as_numpy("output_ids")[0, 0, :n].tolist()
    out = _ensemble(served, True, return_log_probs=True)
    assert len(out) == n and all(_names(r) == {"text_output", "cum_log_probs", "output_log_probs"} for r in out)
    per_token = np.array([r.as_numpy("output_log_probs")[0, 0, 0] for r in out])
    _check_scores(served, tokens, per_token, float(out[-1].as_numpy("cum_log_probs")[0, 0]))


def test_a_batch_scores_each_sequence_it_was_asked_for(served) -> None:
    """Batch of two prompts (lengths differ): row 0 asks, row 1 does not; rows are zero-padded, TRT-LLM's layout."""
    long, short = served["prompt_ids"], served["prompt_ids"][:2]
    ids = np.array([long, short + [0] * (len(long) - len(short))], np.int32)
    inputs = {"input_ids": ids, "input_lengths": np.array([[len(long)], [len(short)]], np.int32),
              "request_output_len": np.array([[BUDGET], [BUDGET]], np.int32),
              "exclude_input_in_output": np.array([[True], [True]]),
              "return_log_probs": np.array([[True], [False]]), "return_context_logits": np.array([[True], [False]])}
    [result] = stream_responses(served["server"].grpc_url, "tensorrt_llm", inputs)
    n = int(result.as_numpy("sequence_length")[0, 0])
    tokens = result.as_numpy("output_ids")[0, 0, :n].tolist()
    per_token = result.as_numpy("output_log_probs")
    assert per_token.shape[:2] == (2, 1) and not per_token[1].any() and not per_token[0, 0, n:].any()
    _check_scores(served, tokens, per_token[0, 0, :n], float(result.as_numpy("cum_log_probs")[0, 0]))
    assert result.as_numpy("cum_log_probs")[1, 0] == 0
    context = result.as_numpy("context_logits")
    assert context.shape == (2, len(long), served["model"].config.vocab_size) and not context[1].any()
    _check_context(served, context[:1])
