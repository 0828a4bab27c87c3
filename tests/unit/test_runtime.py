"""The CPU reference runtime against transformers' Llama on tiny random models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")

from stoker.runtime.generate import generate
from stoker.runtime.llama import ArtifactError, LlamaModel, load_model

TINY = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 2048,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
PROMPT = [1, 17, 300, 5, 999, 42, 42, 7, 1500, 64, 3, 2047]
NO_END = -1  # an end id that can never be sampled


def hf_model(seed: int = 0, **overrides) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**TINY, **overrides})
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    model.config._attn_implementation = "eager"
    # Random init leaves norms at 1.0; perturb them so RMSNorm weights are really exercised.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def write_artifact(model, root: Path, quantization: dict | None = None, end_id: int = 2, pad_id: int = 0) -> Path:
    """Lay out `model` as a stoker reference artifact (float32 safetensors + configs)."""
    root.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(root / "model.safetensors"))
    (root / "config.json").write_text(model.config.to_json_string())
    runtime = {
        "format": "stoker-reference/1",
        "dtype": "float32",
        "end_id": end_id,
        "pad_id": pad_id,
        "quantization": quantization or {"format": "none", "kv_cache_dtype": None, "kv_scales": {}},
    }
    (root / "stoker_runtime.json").write_text(json.dumps(runtime))
    return root


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def our_logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    return model.forward(ids, model.new_cache(len(ids)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[object, LlamaModel, Path]:
    ref = hf_model()
    root = write_artifact(ref, tmp_path_factory.mktemp("artifact"))
    return ref, load_model(root, num_threads=2), root


def test_prefill_logits_match_transformers(tiny) -> None:
    ref, ours, _ = tiny
    diff = (our_logits(ours, PROMPT) - hf_logits(ref, PROMPT)).abs().max().item()
    assert diff < 1e-4


def test_cached_decode_matches_full_forward(tiny) -> None:
    ref, ours, _ = tiny
    cache = ours.new_cache(len(PROMPT))
    ours.forward(PROMPT[:5], cache)
    step_logits = [ours.forward([t], cache)[0] for t in PROMPT[5:]]
    full = hf_logits(ref, PROMPT)[5:]
    assert (torch.stack(step_logits) - full).abs().max().item() < 1e-4


def test_greedy_generation_matches_transformers(tiny) -> None:
    ref, ours, _ = tiny
    with torch.no_grad():
        expected = ref.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                                max_new_tokens=16, do_sample=False)[0, len(PROMPT):].tolist()
    assert len(expected) == 16
    assert list(generate(ours, PROMPT, 16, end_id=NO_END)) == expected


def test_repetition_penalty_matches_transformers(tiny) -> None:
    ref, ours, _ = tiny
    with torch.no_grad():
        expected = ref.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                                max_new_tokens=16, do_sample=False, repetition_penalty=1.5)[0, len(PROMPT):].tolist()
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


def test_llama3_rope_scaling_matches_transformers(tmp_path: Path) -> None:
    rope = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
    ref = hf_model(seed=1, rope_parameters=rope)
    ours = load_model(write_artifact(ref, tmp_path))
    ids = (PROMPT * 3)[:30]  # past original_max_position_embeddings, where the scaling matters
    assert (our_logits(ours, ids) - hf_logits(ref, ids)).abs().max().item() < 1e-4


def test_tied_embeddings_without_lm_head(tmp_path: Path) -> None:
    ref = hf_model(seed=2, tie_word_embeddings=True)
    ours = load_model(write_artifact(ref, tmp_path))
    assert (our_logits(ours, PROMPT) - hf_logits(ref, PROMPT)).abs().max().item() < 1e-4


def kv_amax(model: LlamaModel, ids: list[int]) -> list[tuple[float, float]]:
    cache = model.new_cache(len(ids))
    model.forward(ids, cache)
    return [(cache.k[i].abs().max().item(), cache.v[i].abs().max().item()) for i in range(model.spec.num_layers)]


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


def test_artifact_errors_name_the_problem(tiny, tmp_path: Path) -> None:
    ref, _, _root = tiny
    bad = write_artifact(ref, tmp_path / "rope")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ArtifactError, match="yarn"):
        load_model(bad)

    quant = {"format": "fp8", "kv_cache_dtype": "fp8", "kv_scales": {"0": {"k": 1.0, "v": 1.0}}}
    with pytest.raises(ArtifactError, match="layer 1"):
        load_model(write_artifact(ref, tmp_path / "scales", quantization=quant))

    with pytest.raises(ArtifactError, match="model.safetensors"):
        missing = write_artifact(ref, tmp_path / "weights")
        (missing / "model.safetensors").unlink()
        load_model(missing)
