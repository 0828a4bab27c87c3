"""min_tokens in the reference model: the runtime keeps end_id out until then; the ensemble passes it on."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from stoker.triton import config as tc
from stoker.runtime.generate import generate
from stoker.runtime.model import load_model

PROMPT = [1, 17, 300, 5, 999, 42, 42, 7, 1500, 64, 3, 2047]
NO_END = -1


def _tiny(root: Path):
    """A tiny random Llama as a reference artifact (the layout stoker's build step writes)."""
    import json

    import torch
    import transformers
    from safetensors.torch import save_file

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=2048,
                                      max_position_embeddings=128, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    root.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(root / "model.safetensors"))
    (root / "config.json").write_text(config.to_json_string())
    (root / "stoker_runtime.json").write_text(json.dumps({
        "format": "stoker-reference/1", "dtype": "float32", "end_id": 2, "pad_id": 0,
        "quantization": {"format": "none", "kv_cache_dtype": None, "kv_scales": {}}}))
    return load_model(root, num_threads=1)


def test_min_new_tokens_holds_back_end_id(tmp_path: Path) -> None:
    model = _tiny(tmp_path)
    greedy = list(generate(model, PROMPT, 12, end_id=NO_END))
    k = next(i for i in range(2, 12) if greedy[i] not in greedy[:i])
    end = greedy[k]
    assert list(generate(model, PROMPT, 12, end_id=end)) == greedy[:k]  # EOS ends it early
    held = list(generate(model, PROMPT, 12, end_id=end, min_new_tokens=12))
    assert len(held) == 12 and end not in held  # asked length, and the end id never sampled
    assert held[:k] == greedy[:k]  # before the end id was due nothing changes


def test_ensemble_passes_min_tokens_to_the_model() -> None:
    cfgs = {n: text_format.Parse(t, mc.ModelConfig()) for n, t in tc.render_all(tc.RepoSettings()).items()}
    for name in ("ensemble", "tensorrt_llm"):
        inputs = {i.name: i for i in cfgs[name].input}
        assert inputs["min_tokens"].data_type == mc.TYPE_INT32 and inputs["min_tokens"].optional
    gen = next(s for s in cfgs["ensemble"].ensemble_scheduling.step if s.model_name == "tensorrt_llm")
    assert gen.input_map["min_tokens"] == "min_tokens"
