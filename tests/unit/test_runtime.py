"""The CPU reference runtime (transformers' model class + our loop and KV rounding) against transformers itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from stoker.runtime.generate import generate
from stoker.runtime.kvquant import FakeQuantCache
from stoker.runtime.model import ArtifactError, ReferenceModel, load_model

TINY = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 2048,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
PROMPT = [1, 17, 300, 5, 999, 42, 42, 7, 1500, 64, 3, 2047]
NO_END = -1  # an end id that can never be sampled
CONFIGS = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "mistral": lambda **kw: transformers.MistralConfig(sliding_window=8, **kw)}


def hf_model(arch: str = "llama", seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[arch](**{**TINY, **overrides})).float().eval()
    # Random init leaves norms at 1.0 and biases at 0; perturb them so both are really exercised.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def write_artifact(model, root: Path, quantization: dict | None = None, end_id: int = 2, pad_id: int = 0) -> Path:
    """Lay out `model` as a stoker reference artifact (float32 HF checkpoint + stoker_runtime.json)."""
    model.save_pretrained(root)
    runtime = {
        "format": "stoker-reference/1",
        "dtype": "float32",
        "end_id": end_id,
        "pad_id": pad_id,
        "quantization": quantization or {"format": "none", "kv_cache_dtype": None, "kv_scales": {}},
    }
    (root / "stoker_runtime.json").write_text(json.dumps(runtime))
    return root


def hf_greedy(model, ids: list[int], n: int, cache=None, **kwargs) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, past_key_values=cache, **kwargs)
    return out[0, len(ids):].tolist()


def our_logits(model: ReferenceModel, ids: list[int]) -> torch.Tensor:
    return model.forward(ids, model.new_cache())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[object, ReferenceModel, Path]:
    ref = hf_model()
    root = write_artifact(ref, tmp_path_factory.mktemp("artifact"))
    return ref, load_model(root, num_threads=2), root


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_greedy_generation_matches_transformers(arch, tmp_path: Path) -> None:
    """Qwen2's q/k/v biases and Mistral's sliding window (8 < prompt + 24) come from transformers itself."""
    ref = hf_model(arch)
    ours = load_model(write_artifact(ref, tmp_path), num_threads=2)
    assert ours.architecture == type(ref).__name__
    expected = hf_greedy(ref, PROMPT, 24)
    assert len(expected) == 24
    assert list(generate(ours, PROMPT, 24, end_id=NO_END)) == expected


def test_cached_decode_matches_full_forward(tiny) -> None:
    ref, ours, _ = tiny
    cache = ours.new_cache()
    ours.forward(PROMPT[:5], cache)
    step_logits = [ours.forward([t], cache)[0] for t in PROMPT[5:]]
    with torch.no_grad():
        full = ref(torch.tensor([PROMPT])).logits[0, 5:]
    assert (torch.stack(step_logits) - full).abs().max().item() < 1e-4


def test_repetition_penalty_matches_transformers(tiny) -> None:
    ref, ours, _ = tiny
    expected = hf_greedy(ref, PROMPT, 16, repetition_penalty=1.5)
    got = list(generate(ours, PROMPT, 16, end_id=NO_END, repetition_penalty=1.5))
    assert got == expected
    assert got != list(generate(ours, PROMPT, 16, end_id=NO_END))


def test_end_id_stops_and_is_not_yielded(tiny) -> None:
    _, ours, _ = tiny
    greedy = list(generate(ours, PROMPT, 16, end_id=NO_END))
    k = next(i for i in range(3, 16) if greedy[i] not in greedy[:i])
    assert list(generate(ours, PROMPT, 16, end_id=greedy[k])) == greedy[:k]


def test_generation_stops_at_max_position_embeddings(tmp_path: Path) -> None:
    model = load_model(write_artifact(hf_model(max_position_embeddings=16), tmp_path))
    assert len(list(generate(model, PROMPT, 100, end_id=NO_END))) == 16 - len(PROMPT)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        generate(model, list(range(16)), 4, end_id=NO_END)


def test_sampling_is_seeded_and_top_k_1_is_greedy(tiny) -> None:
    _, ours, _ = tiny
    greedy = list(generate(ours, PROMPT, 12, end_id=NO_END))
    assert list(generate(ours, PROMPT, 12, end_id=NO_END, temperature=1.0, top_k=1, seed=5)) == greedy
    runs = [list(generate(ours, PROMPT, 12, end_id=NO_END, temperature=5.0, top_p=0.95, seed=s)) for s in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_invalid_requests_fail_before_compute(tiny) -> None:
    _, ours, _ = tiny
    bad_calls = [
        {"input_ids": [], "max_new_tokens": 4},
        {"input_ids": [5000], "max_new_tokens": 4},
        {"input_ids": PROMPT, "max_new_tokens": 0},
        {"input_ids": PROMPT, "max_new_tokens": 4, "top_p": 0.0},
        {"input_ids": PROMPT, "max_new_tokens": 4, "repetition_penalty": 0.0},
    ]
    for kwargs in bad_calls:
        with pytest.raises(ValueError):
            generate(ours, end_id=NO_END, **kwargs)


def test_tied_embeddings_without_lm_head(tmp_path: Path) -> None:
    ref = hf_model(seed=2, tie_word_embeddings=True)
    root = write_artifact(ref, tmp_path)
    assert "lm_head.weight" not in load_file(str(root / "model.safetensors"))
    ours = load_model(root)
    with torch.no_grad():
        expected = ref(torch.tensor([PROMPT])).logits[0]
    assert (our_logits(ours, PROMPT) - expected).abs().max().item() < 1e-4


def kv_amax(model: ReferenceModel, ids: list[int]) -> list[tuple[float, float]]:
    cache = model.new_cache()
    model.forward(ids, cache)
    return [(layer.keys.abs().max().item(), layer.values.abs().max().item()) for layer in cache.layers]


@pytest.mark.parametrize("kv_dtype,qmax", [("fp8", 448.0), ("int8", 127.0)])
def test_kv_fake_quant_changes_outputs_slightly(tiny, tmp_path: Path, kv_dtype: str, qmax: float) -> None:
    ref, ours, _ = tiny
    scales = {str(i): {"k": k / qmax, "v": v / qmax} for i, (k, v) in enumerate(kv_amax(ours, PROMPT))}
    quant = {"format": "fp8", "kv_cache_dtype": kv_dtype, "kv_scales": scales}
    quantized = load_model(write_artifact(ref, tmp_path, quantization=quant))
    base, got = our_logits(ours, PROMPT), our_logits(quantized, PROMPT)
    assert (got - base).abs().max().item() > 1e-6, "KV quantization had no effect"
    # Measured here: fp8 ~3% relative logit error, int8 ~1%; a wrong scale or a missing
    # dequantization would be far off.
    assert ((got - base).norm() / base.norm()).item() < 0.1
    assert torch.nn.functional.cosine_similarity(got, base, dim=-1).min().item() > 0.99


def test_kv_rounding_cache_in_transformers_generate_gives_the_served_tokens(tiny, tmp_path: Path) -> None:
    """Our loop over the rounding cache = transformers' generate handed the same cache."""
    ref, ours, _ = tiny
    # Coarse int8 scales, so the rounding visibly changes the greedy path.
    scales = {str(i): {"k": k / 16, "v": v / 16} for i, (k, v) in enumerate(kv_amax(ours, PROMPT))}
    quantized = load_model(write_artifact(ref, tmp_path, quantization={
        "format": "none", "kv_cache_dtype": "int8", "kv_scales": scales}))
    expected = hf_greedy(ref, PROMPT, 24, cache=quantized.new_cache())
    assert list(generate(quantized, PROMPT, 24, end_id=NO_END)) == expected
    assert expected != list(generate(ours, PROMPT, 24, end_id=NO_END))
    assert isinstance(quantized.new_cache(), FakeQuantCache)


def test_artifact_errors_name_the_problem(tiny, tmp_path: Path) -> None:
    ref, _, _root = tiny
    quant = {"format": "fp8", "kv_cache_dtype": "fp8", "kv_scales": {"0": {"k": 1.0, "v": 1.0}}}
    with pytest.raises(ArtifactError, match="layer 1"):
        load_model(write_artifact(ref, tmp_path / "scales", quantization=quant))

    missing = write_artifact(ref, tmp_path / "weights")
    (missing / "model.safetensors").unlink()
    with pytest.raises(ArtifactError, match="model.safetensors"):
        load_model(missing)

    # A tensor the architecture does not expect (a dequantizer naming it wrong) is refused, never left random.
    renamed = write_artifact(ref, tmp_path / "renamed")
    weights = load_file(str(renamed / "model.safetensors"))
    weights["model.layers.0.self_attn.q.weight"] = weights.pop("model.layers.0.self_attn.q_proj.weight")
    save_file(weights, str(renamed / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ArtifactError, match="missing keys for LlamaForCausalLM: model.layers.0.self_attn.q_proj.weight"):
        load_model(renamed)
