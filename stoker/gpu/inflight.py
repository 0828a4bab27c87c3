"""The engine target's Triton repository (`inflight_batcher_llm`), as ModelConfig protobufs.

preprocessing/postprocessing are stoker's python models (the same files the CPU reference
path serves for real); tensorrt_llm is TensorRT-LLM's C++ backend (`backend: "tensorrtllm"`)
declared with upstream's full tensor list, names and types; the ensemble takes upstream's
inputs. Every value is set explicitly: no `${…}` placeholder can survive, and optional
backend parameters stoker does not set are omitted (the backend's default), never left blank.
"""

from __future__ import annotations

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from ..triton import config as triton_config
from ..triton.config import RepoSettings
from . import tokenizer_info

ENGINE_DIR = "/models/tensorrt_llm/1/engine"  # where the serve step mounts the repository
LORA_DIR = "/models/tensorrt_llm/1/lora"  # lora_prefetch_dir: the package's converted adapters (stoker/gpu/lora.py)
# xgrammar_tokenizer_info_path: the package step writes it from the model's tokenizer (stoker/gpu/tokenizer_info.py).
TOKENIZER_INFO_PATH = f"/models/tensorrt_llm/1/{tokenizer_info.FILE}"
EXECUTOR_WORKER = "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker"
LOGITS_DTYPE = "TYPE_FP32"
ENCODER_FEATURES_DTYPE = "TYPE_FP16"
PROMPT_TABLE_DTYPE = "TYPE_FP16"

# tensorrt_llm inputs as upstream declares them: (name, type, dims, optional). Scalars are [1] with
# reshape [] in upstream's config; variable-length ones are ragged.
_I = "TYPE_INT32"
_F = "TYPE_FP32"
_B = "TYPE_BOOL"
TRTLLM_IN: tuple[tuple[str, str, tuple[int, ...], bool], ...] = (
    ("input_ids", _I, (-1,), True), ("encoder_input_features", ENCODER_FEATURES_DTYPE, (-1, -1), True),
    ("encoder_output_lengths", _I, (1,), True), ("input_lengths", _I, (1,), False),
    ("request_output_len", _I, (1,), False), ("num_return_sequences", _I, (1,), True),
    ("draft_input_ids", _I, (-1,), True), ("decoder_input_ids", _I, (-1,), True),
    ("decoder_input_lengths", _I, (1,), True), ("draft_logits", LOGITS_DTYPE, (-1, -1), True),
    ("draft_acceptance_threshold", _F, (1,), True), ("end_id", _I, (1,), True), ("pad_id", _I, (1,), True),
    ("stop_words_list", _I, (2, -1), True), ("bad_words_list", _I, (2, -1), True),
    ("embedding_bias", _F, (-1,), True), ("beam_width", _I, (1,), True), ("temperature", _F, (1,), True),
    ("runtime_top_k", _I, (1,), True), ("runtime_top_p", _F, (1,), True), ("runtime_top_p_min", _F, (1,), True),
    ("runtime_top_p_decay", _F, (1,), True), ("runtime_top_p_reset_ids", _I, (1,), True),
    ("len_penalty", _F, (1,), True), ("early_stopping", _B, (1,), True), ("repetition_penalty", _F, (1,), True),
    ("min_tokens", _I, (1,), True), ("beam_search_diversity_rate", _F, (1,), True),
    ("presence_penalty", _F, (1,), True), ("frequency_penalty", _F, (1,), True), ("seed", "TYPE_UINT64", (1,), True),
    ("return_log_probs", _B, (1,), True), ("return_context_logits", _B, (1,), True),
    ("return_generation_logits", _B, (1,), True), ("return_perf_metrics", _B, (1,), True),
    ("return_num_input_tokens", _B, (1,), True), ("return_num_output_tokens", _B, (1,), True),
    ("exclude_input_in_output", _B, (1,), True), ("stop", _B, (1,), True), ("streaming", _B, (1,), True),
    ("prompt_embedding_table", PROMPT_TABLE_DTYPE, (-1, -1), True), ("prompt_table_extra_ids", "TYPE_UINT64", (-1,), True),
    ("prompt_vocab_size", _I, (1,), True), ("cross_attention_mask", _B, (-1, -1), True),
    ("mrope_rotary_cos_sin", _F, (-1,), True), ("mrope_position_deltas", "TYPE_INT64", (1,), True),
    ("lora_task_id", "TYPE_UINT64", (1,), True), ("lora_weights", "TYPE_FP16", (-1, -1), True),
    ("lora_config", _I, (-1, 3), True), ("context_phase_params", "TYPE_UINT8", (-1,), True),
    ("skip_cross_attn_blocks", _B, (1,), True), ("retention_token_range_starts", _I, (-1,), True),
    ("retention_token_range_ends", _I, (-1,), True), ("retention_token_range_priorities", _I, (-1,), True),
    ("retention_token_range_durations_ms", _I, (-1,), True), ("retention_decode_priority", _I, (1,), True),
    ("retention_decode_duration_ms", _I, (1,), True), ("guided_decoding_guide_type", "TYPE_STRING", (1,), True),
    ("guided_decoding_guide", "TYPE_STRING", (1,), True), ("lookahead_window_size", _I, (1,), True),
    ("lookahead_ngram_size", _I, (1,), True), ("lookahead_verification_set_size", _I, (1,), True),
)
_RAGGED = {"input_ids", "encoder_input_features", "draft_input_ids", "decoder_input_ids", "draft_logits",
           "embedding_bias", "prompt_embedding_table", "prompt_table_extra_ids", "cross_attention_mask",
           "mrope_rotary_cos_sin", "context_phase_params"}
TRTLLM_OUT: tuple[tuple[str, str, tuple[int, ...]], ...] = (
    ("output_ids", _I, (-1, -1)), ("sequence_length", _I, (-1,)), ("cum_log_probs", _F, (-1,)),
    ("output_log_probs", _F, (-1, -1)), ("context_logits", LOGITS_DTYPE, (-1, -1)),
    ("generation_logits", LOGITS_DTYPE, (-1, -1, -1)), ("batch_index", _I, (1,)), ("sequence_index", _I, (1,)),
    ("context_phase_params", "TYPE_UINT8", (-1,)), ("kv_cache_alloc_new_blocks", _I, (1,)),
    ("kv_cache_reused_blocks", _I, (1,)), ("kv_cache_alloc_total_blocks", _I, (1,)),
    ("arrival_time_ns", "TYPE_INT64", (1,)), ("first_scheduled_time_ns", "TYPE_INT64", (1,)),
    ("first_token_time_ns", "TYPE_INT64", (1,)), ("last_token_time_ns", "TYPE_INT64", (1,)),
    ("acceptance_rate", _F, (1,)), ("total_accepted_draft_tokens", _I, (1,)), ("total_draft_tokens", _I, (1,)),
    ("num_input_tokens", _I, (1,)), ("num_output_tokens", _I, (1,)),
)
# Ensemble inputs beyond the reference ensemble's, passed straight to tensorrt_llm (upstream's renames).
# return_num_*: Triton's OpenAI frontend (stoker/gpu/openai_frontend.py) sends both on every request, and
# Triton refuses a request naming an input its model does not declare.
EXTRA_ENSEMBLE_IN: tuple[tuple[str, str, str], ...] = (
    ("min_tokens", _I, "min_tokens"), ("presence_penalty", _F, "presence_penalty"),
    ("frequency_penalty", _F, "frequency_penalty"), ("length_penalty", _F, "len_penalty"),
    ("beam_width", _I, "beam_width"), ("num_return_sequences", _I, "num_return_sequences"),
    ("return_num_input_tokens", _B, "return_num_input_tokens"),
    ("return_num_output_tokens", _B, "return_num_output_tokens"),
)
# Straight from tensorrt_llm to the ensemble's outputs, as upstream's ensemble does: the frontend's usage counts.
EXTRA_ENSEMBLE_OUT: tuple[tuple[str, str], ...] = (("num_input_tokens", _I), ("num_output_tokens", _I))


def settings_for(spec) -> RepoSettings:
    t = spec.triton
    return RepoSettings(max_batch_size=t.max_batch_size, preprocessing_instances=t.instances.preprocessing,
                        model_instances=1, postprocessing_instances=t.instances.postprocessing)


def _b(v: bool) -> str:
    return "true" if v else "false"


def backend_parameters(spec) -> dict[str, str]:
    """tensorrt_llm parameters (keys as upstream's config.pbtxt: gpt_model_type ← batching_strategy, …)."""
    r, b = spec.runtime, spec.build
    p = {
        "max_beam_width": str(b.max_beam_width),
        "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
        "gpt_model_type": "inflight_fused_batching",
        "gpt_model_path": ENGINE_DIR,
        "batch_scheduler_policy": r.batch_scheduler_policy,
        "kv_cache_free_gpu_mem_fraction": str(r.kv_cache_free_gpu_mem_fraction),
        "exclude_input_in_output": _b(r.exclude_input_in_output),
        "cancellation_check_period_ms": str(r.cancellation_check_period_ms),
        "stats_check_period_ms": str(r.stats_check_period_ms),
        "enable_kv_cache_reuse": _b(r.enable_kv_cache_reuse),
        "normalize_log_probs": _b(r.normalize_log_probs),
        "enable_chunked_context": _b(r.enable_chunked_context),
        "executor_worker_path": EXECUTOR_WORKER,
        "enable_context_fmha_fp32_acc": _b(r.enable_context_fmha_fp32_acc),
        "multi_block_mode": _b(r.multi_block_mode),
        "cuda_graph_mode": _b(r.cuda_graph_mode),
        # Without both, the C++ backend builds no guided decoder (model_instance_state.cc,
        # getGuidedDecodingConfigFromParams) and a request's guided_decoding_guide is not enforced; no
        # trtllm-build option is needed (tensorrtllm_backend docs/guided_decoding.md, "C++ Backend").
        "guided_decoding_backend": tokenizer_info.BACKEND,
        "xgrammar_tokenizer_info_path": TOKENIZER_INFO_PATH,
    }
    if r.max_tokens_in_paged_kv_cache is not None:
        p["max_tokens_in_paged_kv_cache"] = str(r.max_tokens_in_paged_kv_cache)
    if r.max_attention_window_size is not None:
        p["max_attention_window_size"] = str(r.max_attention_window_size)
    return p


def tensorrt_llm(spec, extra_parameters: dict[str, str] | None = None) -> mc.ModelConfig:
    r = spec.runtime
    cfg = mc.ModelConfig(name=triton_config.MODEL_NAME, backend="tensorrtllm", max_batch_size=spec.triton.max_batch_size)
    cfg.model_transaction_policy.decoupled = r.decoupled
    db = cfg.dynamic_batching
    db.preferred_batch_size.append(spec.triton.max_batch_size)
    db.max_queue_delay_microseconds = r.max_queue_delay_microseconds
    if r.max_queue_size:
        db.default_queue_policy.max_queue_size = r.max_queue_size
    for name, dtype, dims, optional in TRTLLM_IN:
        t = cfg.input.add(name=name, data_type=mc.DataType.Value(dtype), dims=list(dims), optional=optional)
        if name in _RAGGED:
            t.allow_ragged_batch = True
        elif dims == (1,):
            t.reshape.SetInParent()  # reshape: { shape: [ ] } — a scalar per request, as upstream
    for name, dtype, dims in TRTLLM_OUT:
        cfg.output.add(name=name, data_type=mc.DataType.Value(dtype), dims=list(dims))
    # The C++ backend drives the GPUs itself; Triton's instance is a CPU-side handle.
    cfg.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)
    for k, v in (backend_parameters(spec) | (extra_parameters or {})).items():
        cfg.parameters[k].string_value = v
    return cfg


def ensemble(spec) -> mc.ModelConfig:
    cfg = triton_config.ensemble(settings_for(spec))
    gen = next(s for s in cfg.ensemble_scheduling.step if s.model_name == triton_config.MODEL_NAME)
    declared = {t.name for t in cfg.input}
    for name, dtype, target in EXTRA_ENSEMBLE_IN:
        if name in declared:  # the reference ensemble has it already (min_tokens); a name twice is invalid
            continue
        cfg.input.add(name=name, data_type=mc.DataType.Value(dtype), dims=[1], optional=True)
        gen.input_map[target] = name
    for name, dtype in EXTRA_ENSEMBLE_OUT:
        cfg.output.add(name=name, data_type=mc.DataType.Value(dtype), dims=[1])
        gen.output_map[name] = name
    return cfg


def configs(spec, lora_parameters: dict[str, str] | None = None) -> dict[str, mc.ModelConfig]:
    """``lora_parameters``: the adapters' preload and cache (stoker/gpu/lora.py cache_parameters)."""
    s = settings_for(spec)
    return {"preprocessing": triton_config.preprocessing(s), "tensorrt_llm": tensorrt_llm(spec, lora_parameters),
            "postprocessing": triton_config.postprocessing(s), "ensemble": ensemble(spec)}


def render_all(spec, lora_parameters: dict[str, str] | None = None) -> dict[str, str]:
    return {name: text_format.MessageToString(cfg) for name, cfg in configs(spec, lora_parameters).items()}
