"""Every eos id stops generation: which one is end_id, the stop-word tensor layout, the runtime's stop rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stoker.gpu.facts import from_config, known
from stoker.triton.models.stop_words import StopIds, collect, from_word_list, ids, to_word_lists


def test_ids_reads_an_int_a_list_or_nothing():
    assert (ids(2), ids([128001, 128009]), ids(None), ids([]), ids(True)) == ([2], [128001, 128009], [], [], [])


def test_llama31_end_id_is_the_tokenizers_eos_and_the_others_are_stop_words():
    eos = [128001, 128008, 128009]
    assert collect({"eos_token_id": eos}, {"eos_token_id": eos}, 128009) == StopIds(128009, (128001, 128008))


def test_llama3_instruct_config_and_generation_config_disagree():
    # config.json 128009, generation_config.json [128001, 128009]: both stop, the tokenizer's ends the turn.
    assert collect({"eos_token_id": [128001, 128009]}, {"eos_token_id": 128009}, 128009) == StopIds(128009, (128001,))


def test_without_a_tokenizer_eos_generation_config_comes_first_then_config():
    assert collect({"eos_token_id": [5, 6]}, {"eos_token_id": 7}, None) == StopIds(5, (6, 7))
    assert collect({}, {"eos_token_id": 2}, None) == StopIds(2, ())


def test_a_tokenizer_eos_outside_the_lists_still_ends_and_the_lists_still_stop():
    assert collect({"eos_token_id": 5}, {}, 9) == StopIds(9, (5,))


def test_repeats_are_dropped_in_first_seen_order():
    assert collect({"eos_token_id": [3, 4, 3]}, {"eos_token_id": [4, 5]}, 3) == StopIds(3, (4, 5))


def test_no_eos_anywhere():
    assert collect({}, {}, None) == StopIds(None, ())


def test_word_lists_use_trtllms_layout():
    # ids concatenated (padded with 0), end offsets cumulative (padded with -1), one width per batch.
    assert to_word_lists([[[128001], [128008]], [[5, 6, 7]], []]) == [
        [[128001, 128008, 0], [1, 2, -1]],
        [[5, 6, 7], [3, -1, -1]],
        [[0, 0, 0], [-1, -1, -1]],
    ]
    assert to_word_lists([[]]) == [[[0], [-1]]]  # upstream's "no stop words"


def test_word_lists_round_trip():
    batch = [[[1], [2, 3], [4]], [[9]]]
    assert [from_word_list(rows) for rows in to_word_lists(batch)] == batch


def test_a_malformed_word_list_is_refused():
    with pytest.raises(ValueError, match="2 rows"):
        from_word_list([[1, 2]])
    with pytest.raises(ValueError, match="offset 5"):
        from_word_list([[1, 2], [5, -1]])


def test_gpu_facts_carry_every_eos_id():
    llama = known("meta-llama/Meta-Llama-3-8B-Instruct")
    assert (llama.end_id, llama.stop_ids) == (128009, (128001,))
    f = from_config({"num_attention_heads": 4, "hidden_size": 64, "num_hidden_layers": 1, "vocab_size": 10,
                     "eos_token_id": [1, 2, 3]})
    assert (f.end_id, f.stop_ids, f.pad_id) == (1, (2, 3), 1)


def _checkpoint(root: Path, generation_eos, config_eos, tokenizer_eos: str) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "<eot>": 3, "a": 4},
                                                           unk_token="<unk>"))
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": tokenizer_eos}))
    return root


def test_build_step_records_end_id_and_stop_ids(tmp_path):
    from stoker.workers.build_reference import special_ids

    ckpt = _checkpoint(tmp_path, None, None, "<eot>")
    assert special_ids(ckpt, {"eos_token_id": 2}, {"eos_token_id": [2, 3]}) == (3, 3, [2])
    assert special_ids(ckpt, {"eos_token_id": 2, "pad_token_id": 0}, {}) == (3, 0, [2])


def _tiny_model(root: Path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    from stoker.runtime.model import load_model

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                      max_position_embeddings=128, tie_word_embeddings=False)
    hf = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    root.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in hf.state_dict().items()}, str(root / "model.safetensors"))
    (root / "config.json").write_text(config.to_json_string())
    (root / "stoker_runtime.json").write_text(json.dumps({
        "format": "stoker-reference/1", "dtype": "float32", "end_id": 2, "pad_id": 0,
        "quantization": {"format": "none", "kv_cache_dtype": None, "kv_scales": {}}}))
    return hf, load_model(root, num_threads=1)


def test_runtime_stops_on_any_stop_word_as_transformers_does(tmp_path):
    import torch

    from stoker.runtime.generate import generate

    hf, ours = _tiny_model(tmp_path)
    prompt = [1, 17, 300, 5, 99, 42]
    free = list(generate(ours, prompt, 20, end_id=-1))
    k = next(i for i in range(3, 20) if free[i] not in free[:i])
    never = next(i for i in range(3, 512) if i not in free)
    # Stop word returned (TensorRT-LLM), just as transformers returns an eos it stopped at.
    got = list(generate(ours, prompt, 20, end_id=never, stop_words=[[free[k]]]))
    assert got == free[:k + 1]
    with torch.no_grad():
        hf.generation_config.eos_token_id = [never, free[k]]
        expected = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               max_new_tokens=20, do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    assert got == expected
    # A two-token word ends on its last token; min_tokens holds back end_id only, as TensorRT-LLM's does.
    assert list(generate(ours, prompt, 20, end_id=-1, stop_words=[free[k - 1:k + 1]])) == free[:k + 1]
    assert list(generate(ours, prompt, 20, end_id=-1, stop_words=[[free[k]]], min_new_tokens=20)) == free[:k + 1]
