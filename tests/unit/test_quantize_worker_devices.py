"""Where the quantize worker puts the model: one device as before, or every visible GPU for plain 'cuda'."""

from __future__ import annotations

from stoker.gpu.quantize_worker import WEIGHT_SHARE, layers_per_device, placement

GIB = 1 << 30


def test_several_gpus_span_with_a_cap_per_gpu():
    where = placement("cuda", [80 * GIB, 70 * GIB])
    assert where["device_map"] == "auto"
    assert where["max_memory"] == {0: int(80 * GIB * WEIGHT_SHARE), 1: int(70 * GIB * WEIGHT_SHARE)}


def test_one_gpu_a_named_gpu_and_the_cpu_keep_the_old_path():
    assert placement("cuda", [80 * GIB]) == {}
    assert placement("cuda:1", [80 * GIB, 80 * GIB]) == {}
    assert placement("cpu", []) == {}


def test_the_log_counts_entries_per_device():
    device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "lm_head": 1, "x": "cpu"}
    assert layers_per_device(device_map) == {"cuda:0": 2, "cuda:1": 2, "cpu": 1}
