"""Pure rendering of the ensemble's config.pbtxt files.

Each config is built as Triton's own ModelConfig protobuf (tritonclient ships
model_config_pb2) and printed with text_format, so there is no template and no
`${...}` placeholder that could be left unfilled. Tensor names and types follow
TensorRT-LLM's inflight_batcher_llm layout so standard clients work unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

# (name, type, dims, optional)
Tensor = tuple[str, str, tuple[int, ...], bool]

PREPROCESSING_IN: tuple[Tensor, ...] = (
    ("QUERY", "TYPE_STRING", (1,), False),
    ("REQUEST_OUTPUT_LEN", "TYPE_INT32", (1,), False),
    ("END_ID", "TYPE_INT32", (1,), True),
    ("PAD_ID", "TYPE_INT32", (1,), True),
    ("STOP_WORDS_DICT", "TYPE_STRING", (-1,), True),
)
PREPROCESSING_OUT: tuple[Tensor, ...] = (
    ("INPUT_ID", "TYPE_INT32", (-1,), False),
    ("REQUEST_INPUT_LEN", "TYPE_INT32", (1,), False),
    ("REQUEST_OUTPUT_LEN", "TYPE_INT32", (1,), False),
    ("OUT_END_ID", "TYPE_INT32", (1,), False),
    ("OUT_PAD_ID", "TYPE_INT32", (1,), False),
    # The model's other eos ids (or the request's stop_words) in TensorRT-LLM's stop_words_list layout.
    ("STOP_WORDS_IDS", "TYPE_INT32", (2, -1), False),
)
MODEL_IN: tuple[Tensor, ...] = (
    ("input_ids", "TYPE_INT32", (-1,), False),
    ("input_lengths", "TYPE_INT32", (1,), False),
    ("request_output_len", "TYPE_INT32", (1,), False),
    ("end_id", "TYPE_INT32", (1,), True),
    ("pad_id", "TYPE_INT32", (1,), True),
    ("streaming", "TYPE_BOOL", (1,), True),
    ("temperature", "TYPE_FP32", (1,), True),
    ("runtime_top_k", "TYPE_INT32", (1,), True),
    ("runtime_top_p", "TYPE_FP32", (1,), True),
    ("repetition_penalty", "TYPE_FP32", (1,), True),
    ("seed", "TYPE_UINT64", (1,), True),
    ("exclude_input_in_output", "TYPE_BOOL", (1,), True),
    ("min_tokens", "TYPE_INT32", (1,), True),
    ("stop_words_list", "TYPE_INT32", (2, -1), True),
    # OpenAI's presence/frequency penalties and logit_bias (a [vocab] bias added to the logits), by TensorRT-LLM's
    # names and kernel semantics (stoker_runtime.generate's docstring).
    ("presence_penalty", "TYPE_FP32", (1,), True),
    ("frequency_penalty", "TYPE_FP32", (1,), True),
    ("embedding_bias", "TYPE_FP32", (-1,), True),
    ("return_log_probs", "TYPE_BOOL", (1,), True),
    ("return_context_logits", "TYPE_BOOL", (1,), True),
    ("lora_task_id", "TYPE_UINT64", (1,), True),  # TensorRT-LLM's per-request adapter: one the repository carries
    # TensorRT-LLM's guided decoding (json / json_schema / regex / ebnf_grammar, and the guide): stoker_runtime.guided
    ("guided_decoding_guide_type", "TYPE_STRING", (1,), True),
    ("guided_decoding_guide", "TYPE_STRING", (1,), True),
)
# The reference model's own tensors, beyond TensorRT-LLM's interface: k alternatives per generated token, for the
# OpenAI service's top_logprobs. TensorRT-LLM 1.2.1's `tensorrt_llm` model returns only the sampled token's
# output_log_probs (stoker/gpu/inflight.py TRTLLM_OUT, upstream's full list), so only this model declares them,
# and the service reads their presence in the model's metadata as "top_logprobs is served here".
TOP_LOG_PROBS_IN: tuple[Tensor, ...] = (("return_top_log_probs", "TYPE_INT32", (1,), True),)
TOP_LOG_PROBS_OUT: tuple[Tensor, ...] = (
    ("top_log_prob_ids", "TYPE_INT32", (-1, -1), False),  # generated tokens, k
    ("top_log_probs", "TYPE_FP32", (-1, -1), False),  # generated tokens, k; most likely first
)
# TensorRT-LLM's optional outputs, sent only when the request asks (return_log_probs, return_context_logits).
SCORE_OUT: tuple[Tensor, ...] = (
    ("cum_log_probs", "TYPE_FP32", (-1,), False),  # per beam
    ("output_log_probs", "TYPE_FP32", (-1, -1), False),  # beam, generated tokens
    ("context_logits", "TYPE_FP32", (-1, -1), False),  # prompt tokens, vocab
)
MODEL_OUT: tuple[Tensor, ...] = (
    ("output_ids", "TYPE_INT32", (-1, -1), False),
    ("sequence_length", "TYPE_INT32", (-1,), False),
    *SCORE_OUT,
)
POSTPROCESSING_IN: tuple[Tensor, ...] = (
    ("TOKENS_BATCH", "TYPE_INT32", (-1, -1), False),
    ("SEQUENCE_LENGTH", "TYPE_INT32", (-1,), False),
)
POSTPROCESSING_OUT: tuple[Tensor, ...] = (("OUTPUT", "TYPE_STRING", (-1,), False),)
ENSEMBLE_IN: tuple[Tensor, ...] = (
    ("text_input", "TYPE_STRING", (1,), False),
    ("max_tokens", "TYPE_INT32", (1,), False),
    ("stream", "TYPE_BOOL", (1,), True),
    ("end_id", "TYPE_INT32", (1,), True),
    ("pad_id", "TYPE_INT32", (1,), True),
    ("top_k", "TYPE_INT32", (1,), True),
    ("top_p", "TYPE_FP32", (1,), True),
    ("temperature", "TYPE_FP32", (1,), True),
    ("repetition_penalty", "TYPE_FP32", (1,), True),
    ("presence_penalty", "TYPE_FP32", (1,), True),
    ("frequency_penalty", "TYPE_FP32", (1,), True),
    ("seed", "TYPE_UINT64", (1,), True),
    ("exclude_input_in_output", "TYPE_BOOL", (1,), True),
    ("min_tokens", "TYPE_INT32", (1,), True),  # lets a benchmark ask for an exact OSL (ignore EOS)
    ("stop_words", "TYPE_STRING", (-1,), True),  # replaces the model's default stop words; [""] for none
    ("return_log_probs", "TYPE_BOOL", (1,), True),
    ("return_context_logits", "TYPE_BOOL", (1,), True),
    ("lora_task_id", "TYPE_UINT64", (1,), True),  # a LoRA adapter of the spec's (stoker/adapters.py task_id)
)
ENSEMBLE_OUT: tuple[Tensor, ...] = (("text_output", "TYPE_STRING", (-1,), False), *SCORE_OUT)

MODEL_NAME = "tensorrt_llm"  # the model step keeps upstream's name so BLS/clients find it
ENSEMBLE_NAME = "ensemble"


@dataclass(frozen=True)
class RepoSettings:
    max_batch_size: int = 8
    preprocessing_instances: int = 1
    model_instances: int = 1
    postprocessing_instances: int = 1
    model_threads: int = 2
    tokenizer_dir: str = "tokenizer"
    weights_dir: str = "weights"


def _io(cfg_list, tensors: tuple[Tensor, ...], with_optional: bool) -> None:
    for name, dtype, dims, optional in tensors:
        t = cfg_list.add(name=name, data_type=mc.DataType.Value(dtype), dims=list(dims))
        if with_optional and optional:
            t.optional = True


def _python_model(name: str, s: RepoSettings, inputs, outputs, instances: int, params: dict[str, str]) -> mc.ModelConfig:
    cfg = mc.ModelConfig(name=name, backend="python", max_batch_size=s.max_batch_size)
    _io(cfg.input, inputs, True)
    _io(cfg.output, outputs, False)
    cfg.instance_group.add(count=instances, kind=mc.ModelInstanceGroup.KIND_CPU)
    for k, v in params.items():
        cfg.parameters[k].string_value = v
    return cfg


def preprocessing(s: RepoSettings) -> mc.ModelConfig:
    return _python_model("preprocessing", s, PREPROCESSING_IN, PREPROCESSING_OUT, s.preprocessing_instances,
                         {"tokenizer_dir": s.tokenizer_dir, "add_special_tokens": "true"})


def model(s: RepoSettings) -> mc.ModelConfig:
    cfg = _python_model(MODEL_NAME, s, MODEL_IN + TOP_LOG_PROBS_IN, MODEL_OUT + TOP_LOG_PROBS_OUT, s.model_instances,
                        {"gpt_model_path": s.weights_dir, "num_threads": str(s.model_threads)})
    # Streaming sends one response per token: only a decoupled model may do that.
    cfg.model_transaction_policy.decoupled = True
    return cfg


def postprocessing(s: RepoSettings) -> mc.ModelConfig:
    cfg = _python_model("postprocessing", s, POSTPROCESSING_IN, POSTPROCESSING_OUT, s.postprocessing_instances,
                        {"tokenizer_dir": s.tokenizer_dir, "skip_special_tokens": "true"})
    # As upstream's: while the instance decodes, the tokens that other sequences' steps streamed meanwhile queue
    # and go to it together, one execute (one round trip to the Python stub) for all of them. No queue delay:
    # a token that finds the instance idle is decoded at once.
    cfg.dynamic_batching.SetInParent()
    return cfg


def ensemble(s: RepoSettings) -> mc.ModelConfig:
    cfg = mc.ModelConfig(name=ENSEMBLE_NAME, platform="ensemble", max_batch_size=s.max_batch_size)
    _io(cfg.input, ENSEMBLE_IN, True)
    _io(cfg.output, ENSEMBLE_OUT, False)
    steps = cfg.ensemble_scheduling.step
    pre = steps.add(model_name="preprocessing", model_version=-1)
    pre.input_map.update({"QUERY": "text_input", "REQUEST_OUTPUT_LEN": "max_tokens",
                          "END_ID": "end_id", "PAD_ID": "pad_id", "STOP_WORDS_DICT": "stop_words"})
    pre.output_map.update({"INPUT_ID": "_INPUT_ID", "REQUEST_INPUT_LEN": "_REQUEST_INPUT_LEN",
                           "REQUEST_OUTPUT_LEN": "_REQUEST_OUTPUT_LEN", "OUT_END_ID": "_PREPROCESSOR_END_ID",
                           "OUT_PAD_ID": "_PREPROCESSOR_PAD_ID", "STOP_WORDS_IDS": "_STOP_WORDS_IDS"})
    gen = steps.add(model_name=MODEL_NAME, model_version=-1)
    # Renamed on the way in, as upstream does: stream→streaming, top_k→runtime_top_k, top_p→runtime_top_p.
    gen.input_map.update({"input_ids": "_INPUT_ID", "input_lengths": "_REQUEST_INPUT_LEN",
                          "request_output_len": "_REQUEST_OUTPUT_LEN", "end_id": "_PREPROCESSOR_END_ID",
                          "pad_id": "_PREPROCESSOR_PAD_ID", "streaming": "stream", "runtime_top_k": "top_k",
                          "runtime_top_p": "top_p", "temperature": "temperature",
                          "repetition_penalty": "repetition_penalty", "seed": "seed",
                          "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                          # Like TensorRT-LLM, a non-streamed answer includes the prompt unless asked not to.
                          "exclude_input_in_output": "exclude_input_in_output", "min_tokens": "min_tokens",
                          "stop_words_list": "_STOP_WORDS_IDS", "return_log_probs": "return_log_probs",
                          "return_context_logits": "return_context_logits", "lora_task_id": "lora_task_id"})
    gen.output_map.update({"output_ids": "_TOKENS_BATCH", "sequence_length": "_SEQUENCE_LENGTH"})
    # Straight to the ensemble's outputs, as upstream's ensemble does; absent when not asked for.
    gen.output_map.update({name: name for name, *_ in SCORE_OUT})
    post = steps.add(model_name="postprocessing", model_version=-1)
    post.input_map.update({"TOKENS_BATCH": "_TOKENS_BATCH", "SEQUENCE_LENGTH": "_SEQUENCE_LENGTH"})
    post.output_map.update({"OUTPUT": "text_output"})
    return cfg


def render(cfg: mc.ModelConfig) -> str:
    """config.pbtxt text for one model."""
    return text_format.MessageToString(cfg)


def render_all(s: RepoSettings) -> dict[str, str]:
    """model name → config.pbtxt text, for the whole ensemble."""
    return {c.name: render(c) for c in (preprocessing(s), model(s), postprocessing(s), ensemble(s))}
