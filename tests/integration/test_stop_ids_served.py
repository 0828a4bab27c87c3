"""Every eos id stops a served generation exactly where transformers' greedy generate stops.

An unquantized tiny Llama (stoker.workers.tinymodel) gets a Llama-3.1-style eos list of three
ids, with the tokenizer's eos last (as <|eot_id|> is): [never emitted, stop word, tokenizer eos].
The ids are tokens the random model greedily emits, so the stops really happen within the
budget. The checkpoint then goes through stoker's own build step and repository assembly, is
served by the real tritonserver (python backend, local) and compared with transformers
`generate(do_sample=False)` token for token. TensorRT-LLM's semantics decide the one allowed
difference: end_id is never returned, while a matched stop word is (transformers returns both).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytestmark = [pytest.mark.triton, pytest.mark.slow]

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("pytriton")
grpcclient = pytest.importorskip("tritonclient.grpc")
from tokenizers import Tokenizer

from grpc_stream import serve_checkpoint, stream_responses

from stoker.workers.tinymodel import make_tiny_model

# Picked for the seed-0 tiny model: the first greedily reaches a stop word, the second the tokenizer eos,
# the third neither within the budget (ids are chosen from the free runs, so only the roles are fixed).
PROMPTS = ("The quick brown fox", "Hello world", "Triton serves models")
BUDGET = 24


def _hf_greedy(model, prompt_ids: list[int], eos: list[int] | int | None) -> list[int]:
    """transformers' greedy continuation (new tokens only), stopping at any of `eos`."""
    model.generation_config.eos_token_id = eos
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             max_new_tokens=BUDGET, do_sample=False, pad_token_id=3)
    return out[0, len(prompt_ids):].tolist()


def _first_new(run: list[int], avoid: set[int]) -> int | None:
    """Position of the first token (from the 4th on) seen for the first time in `run` and not in `avoid`."""
    return next((i for i in range(3, len(run)) if run[i] not in run[:i] and run[i] not in avoid), None)


def _choose_ids(free: list[list[int]]) -> tuple[int, int, int]:
    """(never, stop word, tokenizer eos): prompt 0 hits the stop word first, prompt 1 the tokenizer eos."""
    k = _first_new(free[0], set())
    stop = free[0][k]
    j = _first_new(free[1], {stop} | set(free[0][:k + 1]))
    assert j is not None, "the random model emits nothing suitable; change the seed"
    eos = free[1][j]
    assert stop not in free[1][:j]
    seen = {t for run in free for t in run}
    never = next(i for i in range(4, 2048) if i not in seen)
    return never, stop, eos


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("stop-ids")
    ckpt = root / "checkpoint"
    make_tiny_model(ckpt, seed=0)
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    model = transformers.LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    prompts = [tok.encode(p).ids for p in PROMPTS]
    free = [_hf_greedy(model, p, None) for p in prompts]
    never, stop, eos = _choose_ids(free)
    # Llama 3.1's shape: the same three-id list in both configs, the tokenizer's eos last.
    for name in ("config.json", "generation_config.json"):
        doc = json.loads((ckpt / name).read_text())
        doc["eos_token_id"] = [never, stop, eos]
        (ckpt / name).write_text(json.dumps(doc, indent=2))
    tok_config = json.loads((ckpt / "tokenizer_config.json").read_text())
    tok_config["eos_token"] = tok.id_to_token(eos)
    (ckpt / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))

    with serve_checkpoint(ckpt, root) as (server, artifact):
        yield {"server": server, "tok": tok, "model": model, "prompts": prompts, "ids": (never, stop, eos),
               "artifact": artifact}


def _stream(served, model_name: str, inputs: dict[str, np.ndarray]) -> list:
    return stream_responses(served["server"].grpc_url, model_name, inputs)


def _served_texts(served, prompt: str, **extra: np.ndarray) -> list[str]:
    inputs = {"text_input": np.array([[prompt.encode()]], dtype=object),
              "max_tokens": np.array([[BUDGET]], np.int32), "stream": np.array([[True]]), **extra}
    return [r.as_numpy("text_output").reshape(-1)[0].decode() for r in _stream(served, "ensemble", inputs)]


def _trtllm_semantics(hf: list[int], end_id: int) -> list[int]:
    """transformers' output as TensorRT-LLM returns it: without a final end_id, with a final stop word."""
    return hf[:-1] if hf and hf[-1] == end_id else hf


def test_build_records_one_end_id_and_the_other_eos_ids_as_stop_ids(served) -> None:
    never, stop, eos = served["ids"]
    runtime = json.loads((served["artifact"] / "stoker_runtime.json").read_text())
    assert (runtime["end_id"], runtime["stop_ids"]) == (eos, [never, stop])


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_served_greedy_output_equals_transformers_including_the_stop(served, index) -> None:
    never, stop, eos = served["ids"]
    expected_hf = _hf_greedy(served["model"], served["prompts"][index], [never, stop, eos])
    expected = _trtllm_semantics(expected_hf, eos)
    if index == 0:
        assert expected_hf[-1] == stop and expected[-1] == stop  # stopped by a non-first eos id, returned
    if index == 1:
        assert expected_hf[-1] == eos and len(expected) == len(expected_hf) - 1  # stopped by end_id
    if index == 2:
        assert len(expected) == BUDGET
    texts = _served_texts(served, PROMPTS[index])
    assert texts == [served["tok"].decode([t]) for t in expected]


def test_served_ids_through_preprocessing_and_model(served) -> None:
    """The same, in ids: preprocessing's default STOP_WORDS_IDS feeds tensorrt_llm's stop_words_list."""
    never, stop, eos = served["ids"]
    with grpcclient.InferenceServerClient(served["server"].grpc_url) as client:
        q = grpcclient.InferInput("QUERY", [1, 1], "BYTES")
        q.set_data_from_numpy(np.array([[PROMPTS[0].encode()]], dtype=object))
        n = grpcclient.InferInput("REQUEST_OUTPUT_LEN", [1, 1], "INT32")
        n.set_data_from_numpy(np.array([[BUDGET]], np.int32))
        pre = client.infer("preprocessing", [q, n])
    words = pre.as_numpy("STOP_WORDS_IDS")
    assert words.tolist() == [[[never, stop], [1, 2]]]  # TRT-LLM's [batch, 2, N] layout
    assert pre.as_numpy("OUT_END_ID").tolist() == [[eos]]
    out = _stream(served, "tensorrt_llm", {
        "input_ids": pre.as_numpy("INPUT_ID"), "input_lengths": pre.as_numpy("REQUEST_INPUT_LEN"),
        "request_output_len": pre.as_numpy("REQUEST_OUTPUT_LEN"), "end_id": pre.as_numpy("OUT_END_ID"),
        "stop_words_list": words, "exclude_input_in_output": np.array([[True]])})
    [result] = out
    got = result.as_numpy("output_ids")[0, 0, :result.as_numpy("sequence_length")[0, 0]].tolist()
    hf = _hf_greedy(served["model"], served["prompts"][0], [never, stop, eos])
    assert got == _trtllm_semantics(hf, eos) and got[-1] == stop


def test_a_requests_own_stop_words_replace_the_defaults(served) -> None:
    """stop_words [""] tokenizes to no words: only end_id stops, as transformers with eos = end_id alone."""
    never, stop, eos = served["ids"]
    hf = _hf_greedy(served["model"], served["prompts"][0], eos)
    assert stop in hf  # it ran past the default stop word
    texts = _served_texts(served, PROMPTS[0], stop_words=np.array([[b""]], dtype=object))
    assert texts == [served["tok"].decode([t]) for t in _trtllm_semantics(hf, eos)]
