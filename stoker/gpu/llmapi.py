"""The LLM-API target's Triton repository (`llmapi`): one python model `tensorrt_llm` + model.yaml.

The config declares upstream's inputs/outputs (names and types of TRT-LLM 1.2's
triton_backend/all_models/llmapi). Upstream leaves max_batch_size and decoupled unset and lets the model's
auto_complete_config set them from model.yaml's triton_config; stoker writes both into config.pbtxt too, with the
same values: a tensor × pipeline > 1 backend runs every MPI rank with --disable-auto-complete-config (as
upstream's launch_triton_server.py does), where an unset `decoupled` stays false and the model cannot stream.
Triton's python backend accepts an auto-complete that sets the value a config already has. model.py is a stoker shim that loads TensorRT-LLM's own llmapi model.py
from the serving image, so the python model always matches the image's TRT-LLM.

Stop ids: the LLM API ends a request at the tokenizer's eos only (its SamplingParams.end_id), so
the shim adds the model's other eos ids (1/stoker_stop_ids.json) as `stop_token_ids` to every
request that names no `sampling_param_stop` of its own.
"""

from __future__ import annotations

import json

import yaml
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

MODEL_NAME = "tensorrt_llm"
CHECKPOINT_DIR = "/models/tensorrt_llm/1/checkpoint"  # the serve step mounts the repository at /models

LLMAPI_IN: tuple[tuple[str, str, bool], ...] = (
    ("text_input", "TYPE_STRING", False), ("streaming", "TYPE_BOOL", True),
    ("sampling_param_best_of", "TYPE_INT32", True), ("sampling_param_temperature", "TYPE_FP32", True),
    ("sampling_param_top_k", "TYPE_INT32", True), ("sampling_param_top_p", "TYPE_FP32", True),
    ("sampling_param_frequency_penalty", "TYPE_FP32", True), ("sampling_param_presence_penalty", "TYPE_FP32", True),
    ("sampling_param_max_tokens", "TYPE_INT32", True), ("sampling_param_stop", "TYPE_STRING", True),
    ("sampling_param_seed", "TYPE_UINT64", True), ("sampling_param_exclude_input_from_output", "TYPE_BOOL", True),
    ("sampling_param_return_perf_metrics", "TYPE_BOOL", True), ("return_finish_reason", "TYPE_BOOL", True),
    ("return_stop_reason", "TYPE_BOOL", True), ("return_cumulative_logprob", "TYPE_BOOL", True),
    ("stop", "TYPE_BOOL", True),
)
LLMAPI_OUT: tuple[tuple[str, str], ...] = (
    ("text_output", "TYPE_STRING"), ("finish_reason", "TYPE_STRING"), ("stop_reason", "TYPE_STRING"),
    ("cumulative_logprob", "TYPE_FP32"), ("kv_cache_reused_block", "TYPE_INT32"),
    ("kv_cache_missed_block", "TYPE_INT32"), ("kv_cache_alloc_new_blocks", "TYPE_INT32"),
    ("kv_cache_alloc_total_blocks", "TYPE_INT32"), ("kv_cache_hit_rate", "TYPE_FP32"),
    ("arrival_time_ns", "TYPE_INT64"), ("first_scheduled_time_ns", "TYPE_INT64"),
    ("first_token_time_ns", "TYPE_INT64"), ("last_token_time_ns", "TYPE_INT64"), ("acceptance_rate", "TYPE_FP32"),
    ("total_accepted_draft_tokens", "TYPE_INT32"), ("total_draft_tokens", "TYPE_INT32"),
)

SHIM = '''"""stoker: serve TensorRT-LLM's own llmapi model from the serving image (TRT-LLM 1.2.1).

model.yaml is read by that model from this folder (pb_utils.get_model_dir()). Set
STOKER_LLMAPI_MODEL_DIR if the image keeps the model elsewhere.
"""
import importlib.util
import json
import os
import sys

_DIR = os.environ.get("STOKER_LLMAPI_MODEL_DIR", "/app/all_models/llmapi/tensorrt_llm/1")
if not os.path.isfile(os.path.join(_DIR, "model.py")):
    raise ImportError(f"TensorRT-LLM's llmapi model.py not found in {_DIR}: serve with the pinned "
                      "nvcr.io/nvidia/tritonserver:<tag>-trtllm-python-py3 image or set STOKER_LLMAPI_MODEL_DIR")
sys.path.insert(0, _DIR)  # its `from helpers import ...`
_spec = importlib.util.spec_from_file_location("trtllm_llmapi_model", os.path.join(_DIR, "model.py"))
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)

# The model's eos ids other than the tokenizer's (Llama 3.1 Instruct: 128001, 128008) stop generation too.
_STOP_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stoker_stop_ids.json")
with open(_STOP_FILE) as _fh:
    _STOP_IDS = [int(i) for i in json.load(_fh)["stop_token_ids"]]
_upstream_sampling = _module.get_sampling_params_from_request


def _sampling_with_stop_ids(request, *args, **kwargs):
    params = _upstream_sampling(request, *args, **kwargs)
    if _STOP_IDS and params.get("stop") is None and not params.get("stop_token_ids"):
        params["stop_token_ids"] = list(_STOP_IDS)  # a request's own stop strings replace them
    return params


_module.get_sampling_params_from_request = _sampling_with_stop_ids
TritonPythonModel = _module.TritonPythonModel
'''


def config(spec) -> mc.ModelConfig:
    cfg = mc.ModelConfig(name=MODEL_NAME, backend="python")
    for name, dtype, optional in LLMAPI_IN:
        cfg.input.add(name=name, data_type=mc.DataType.Value(dtype), dims=[1] if name != "sampling_param_stop" else [-1],
                      optional=optional)
    for name, dtype in LLMAPI_OUT:
        cfg.output.add(name=name, data_type=mc.DataType.Value(dtype), dims=[-1])
    cfg.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)
    cfg.max_batch_size = 0  # model_yaml's triton_config: batching happens inside TensorRT-LLM
    cfg.model_transaction_policy.decoupled = spec.runtime.decoupled
    return cfg


def model_yaml(spec, max_seq_len: int | None) -> dict:
    """model.yaml: upstream's five keys, then LLM(**kwargs) arguments from the spec's build/runtime limits."""
    b, r = spec.build, spec.runtime
    doc: dict = {
        "model": CHECKPOINT_DIR,
        "backend": "pytorch",
        "tensor_parallel_size": spec.parallel.tensor,
        "pipeline_parallel_size": spec.parallel.pipeline,
        # Upstream: batching happens inside TRT-LLM, so Triton's max_batch_size stays 0.
        "triton_config": {"max_batch_size": 0, "decoupled": r.decoupled,
                          "cancellation_check_period_ms": r.cancellation_check_period_ms},
        "max_batch_size": b.max_batch_size,
        "max_num_tokens": b.max_num_tokens,
        # The LLM API refuses a longer prompt (TorchLlmArgs max_input_len), as trtllm-build's engine does.
        "max_input_len": b.max_input_len,
        "kv_cache_config": {"free_gpu_memory_fraction": r.kv_cache_free_gpu_mem_fraction,
                            "enable_block_reuse": r.enable_kv_cache_reuse},
        "enable_chunked_prefill": r.enable_chunked_context,
        "scheduler_config": {"capacity_scheduler_policy": r.batch_scheduler_policy.upper()},
    }
    if r.max_tokens_in_paged_kv_cache is not None:
        # A shared rollout's KV budget (stoker/gpu/rollout.py): two backends on one GPU set each keep to it. The
        # LLM API's KvCacheConfig takes the smaller of max_tokens and what free_gpu_memory_fraction allows.
        doc["kv_cache_config"]["max_tokens"] = r.max_tokens_in_paged_kv_cache
    if max_seq_len is not None:
        doc["max_seq_len"] = max_seq_len
    return doc


def render_all(spec, max_seq_len: int | None, stop_ids: tuple[int, ...] = ()) -> dict[str, str]:
    """relative path → file text for the whole repository (checkpoint files excluded)."""
    return {f"{MODEL_NAME}/config.pbtxt": text_format.MessageToString(config(spec)),
            f"{MODEL_NAME}/1/model.yaml": yaml.safe_dump(model_yaml(spec, max_seq_len), sort_keys=False),
            f"{MODEL_NAME}/1/model.py": SHIM,
            f"{MODEL_NAME}/1/stoker_stop_ids.json": json.dumps({"stop_token_ids": list(stop_ids)}) + "\n"}
