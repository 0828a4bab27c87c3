"""The quantize worker's GPU memory estimate (stoker/gpu/memory.py): its terms, its split over GPUs, its ordering."""

from __future__ import annotations

from dataclasses import replace

from stoker.gpu import memory, rules
from stoker.gpu.facts import known

LLAMA3_8B = known("meta-llama/Meta-Llama-3-8B-Instruct")
TINY = replace(LLAMA3_8B, hidden=256, intermediate=512, layers=4, heads=8, kv_heads=2, head_dim=32, vocab=2048)
GIB = 1 << 30


def test_a_hand_computed_case():
    # TINY, fp8, one GPU, 2 × 8 calibration tokens, bf16. One layer: attention 256·32·(2·8 + 2·2) = 163,840 and
    # MLP 3·256·512 = 393,216 → 557,056 quantized parameters, + 2 norms of 256 → 1,115,136 bytes.
    weights = 4 * 1_115_136 + 2 * 2048 * 256 * 2  # 4 layers + embedding and lm_head: 6,557,696
    # Calibration: 16 tokens × (3·512 + 6·256) × 2 B = 98,304; KV cache 2·4 layers·16·64·2 B = 16,384;
    # |W| of one 256 × 512 matrix, 262,144; logits 16 × 2048 × 2 B = 65,536.
    calibration = 98_304 + 16_384 + 262_144 + 65_536
    # Export: q|k|v of 4 layers, 4·256·(256 + 128)·2 B = 786,432; packing one 256 × 512 matrix to FP8, 3 B each =
    # 393,216; the embedding's copy, 1,048,576. fp8 keeps no per-block state or scales.
    export = 786_432 + 393_216 + 1_048_576
    expected = weights + calibration + export + memory.CUDA_CONTEXT_BYTES
    assert memory.quantize_peak_bytes(TINY, "fp8", 1, calib_batch=2, calib_seq=8) == expected
    [peak] = memory.gpu_peaks(TINY, "fp8", 1, 2, 8)
    assert (peak.weights, peak.state, peak.calibration, peak.export) == (weights, 0, calibration, export)


def test_two_gpus_split_llama_3_8b_as_transformers_places_it():
    # transformers 5.17 + Accelerate 1.15 put the embedding and 14 layers on cuda:0, 18 layers and lm_head on cuda:1
    # (measured on two H200s); 5.23's larger buffer puts 16 on each.
    first, second = memory.split(LLAMA3_8B, 2)
    assert (first.layers, first.embedding, first.lm_head) == (14, True, False)
    assert (second.layers, second.embedding, second.lm_head) == (18, False, True)
    assert [s.layers for s in memory.split(LLAMA3_8B, 2, buffer_rule="biggest_leaf")] == [16, 16]
    assert [s.layers for s in memory.split(LLAMA3_8B, 4)] == [5, 10, 10, 7]


def test_a_tied_lm_head_stays_with_the_embedding():
    tied = replace(LLAMA3_8B, tied_embeddings=True)
    shares = memory.split(tied, 2)
    assert shares[0].embedding and shares[0].lm_head and not shares[1].lm_head
    # The shared table is counted once: the GPUs together hold the 16-bit model less its final norm.
    held = sum(p.weights for p in memory.gpu_peaks(tied, "fp8", 2, 4, 128))
    assert held == rules.weight_bytes(tied, "none") - tied.hidden * 2


def test_spanning_two_gpus_about_halves_the_peak():
    one = memory.quantize_peak_bytes(LLAMA3_8B, "fp8", 1, 4, 128)
    two = memory.quantize_peak_bytes(LLAMA3_8B, "fp8", 2, 4, 128)
    # ~15 GiB of bf16 weights + ~3 GiB of export and calibration copies + the context (measured: 19,177 MiB).
    assert 18 * GIB < one < 19.5 * GIB
    # The busier GPU holds 18 of 32 layers and lm_head, and each GPU its context: a little over half.
    assert 0.5 < two / one < 0.55


def test_formats_order_by_what_they_keep():
    peak = {f: memory.quantize_peak_bytes(LLAMA3_8B, f, 1, 4, 128) for f in ("fp8", "nvfp4", "int4_awq")}
    # nvfp4's export adds an FP8 scale per 16 weights; int4_awq keeps a float32 amax per 128 weights, builds a scale
    # per 128 and searches with extra weight copies.
    assert peak["fp8"] < peak["nvfp4"] < peak["int4_awq"]


def test_a_large_calibration_batch_outgrows_the_export():
    small = memory.gpu_peaks(LLAMA3_8B, "fp8", 1, 4, 128)[0]
    big = memory.gpu_peaks(LLAMA3_8B, "fp8", 1, 32, 4096)[0]
    assert small.export > small.calibration
    # 131,072 tokens of 128,256 bf16 logits alone are 31 GiB.
    assert big.calibration > big.export
    assert big.total - small.total == big.calibration - small.calibration
