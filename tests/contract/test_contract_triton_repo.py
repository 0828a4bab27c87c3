"""Contract: rendered Triton repositories against upstream's inflight_batcher_llm / llmapi configs."""

from __future__ import annotations

import pytest
import yaml
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

# Filled values for upstream's type placeholders.
TYPE_FILL = {"${logits_datatype}": "TYPE_FP32", "${encoder_input_features_data_type}": "TYPE_FP16",
             "${prompt_embedding_table_data_type}": "TYPE_FP16"}


def _load(repo, model: str) -> mc.ModelConfig:
    return text_format.Parse((repo / model / "config.pbtxt").read_text(), mc.ModelConfig())


def _io(tensors) -> dict[str, tuple[str, bool]]:
    return {t.name: (mc.DataType.Name(t.data_type), getattr(t, "optional", False)) for t in tensors}


def _upstream_io(entries, with_optional=True) -> dict[str, tuple[str, bool]]:
    return {e["name"]: (TYPE_FILL.get(e["data_type"], e["data_type"]), e.get("optional", False) if with_optional else False)
            for e in entries}


def test_no_placeholder_in_any_config(rendered):
    configs = [p for p in rendered["repo"].rglob("*") if p.name in ("config.pbtxt", "model.yaml")]
    assert configs
    for path in configs:
        assert "${" not in path.read_text(), path
        if path.name == "config.pbtxt":
            text_format.Parse(path.read_text(), mc.ModelConfig())  # a valid ModelConfig


@pytest.mark.targets("tensorrt")
def test_engine_repository_matches_inflight_batcher_llm(rendered, ibl):
    repo = rendered["repo"]
    assert sorted(p.name for p in repo.iterdir()) == ["ensemble", "postprocessing", "preprocessing", "tensorrt_llm"]
    trt = _load(repo, "tensorrt_llm")
    up = ibl["tensorrt_llm"]
    assert trt.backend == "tensorrtllm"
    # Mandatory: triton_backend, triton_max_batch_size, decoupled_mode, max_queue_delay_microseconds, max_queue_size,
    # engine_dir (gpt_model_path), batching_strategy (gpt_model_type), encoder_input_features_data_type, logits_datatype.
    assert trt.max_batch_size >= 1 and trt.model_transaction_policy.decoupled
    assert trt.HasField("dynamic_batching")
    params = {k: v.string_value for k, v in trt.parameters.items()}
    assert params["gpt_model_type"] == "inflight_fused_batching"
    assert params["gpt_model_path"] == "/models/tensorrt_llm/1/engine"
    assert set(params) <= set(up["parameters"]), set(params) - set(up["parameters"])
    for k, v in up["parameters_fixed_values"].items():
        assert params[k] == v
    assert all(v != "" for v in params.values())
    assert 0 < float(params["kv_cache_free_gpu_mem_fraction"]) <= 1
    assert params["batch_scheduler_policy"] in ("max_utilization", "guaranteed_no_evict")
    # Tensor names, types and optionality exactly as upstream (data types with their placeholders filled).
    assert _io(trt.input) == _upstream_io(up["inputs"])
    assert {k: v[0] for k, v in _io(trt.output).items()} == {k: v[0] for k, v in _upstream_io(up["outputs"]).items()}
    # preprocessing / postprocessing: a subset of upstream's tensors with the same types and optionality.
    for name in ("preprocessing", "postprocessing"):
        cfg, ref = _load(repo, name), ibl[name]
        got_in, ref_in = _io(cfg.input), _upstream_io(ref["inputs"])
        assert all(ref_in[k] == v for k, v in got_in.items()), name
        assert all(ref_in[k][1] or k in got_in for k in ref_in if not ref_in[k][1]), f"{name} misses a required input"
        ref_out = {k: v[0] for k, v in _upstream_io(ref["outputs"]).items()}
        assert all(ref_out[k] == v[0] for k, v in _io(cfg.output).items()), name
        assert set(cfg.parameters) <= set(ref["parameters"])
        # Dynamic batching where upstream has it (postprocessing: the tokens streamed meanwhile go in one execute).
        assert cfg.HasField("dynamic_batching") == ("dynamic_batching" in ref), name
    ens = _load(repo, "ensemble")
    ref_ens = _upstream_io(ibl["ensemble"]["inputs"])
    got = _io(ens.input)
    assert all(ref_ens[k] == v for k, v in got.items())
    assert {"text_input", "max_tokens"} <= set(got) and "text_output" in {o.name for o in ens.output}
    gen = next(s for s in ens.ensemble_scheduling.step if s.model_name == "tensorrt_llm")
    trt_inputs = {t.name for t in trt.input}
    assert set(gen.input_map) <= trt_inputs
    for outer, inner in ibl["ensemble"]["ensemble_input_renames_to_tensorrt_llm"].items():
        if outer in got and not inner.startswith("REQUEST_OUTPUT_LEN"):
            assert gen.input_map[inner] == outer, outer
    assert [s.model_name for s in ens.ensemble_scheduling.step] == ibl["ensemble"]["ensemble_steps"]


@pytest.mark.targets("tensorrt")
def test_every_eos_id_stops_the_engine(rendered):
    """Llama 3 Instruct: config.json eos 128009, generation_config [128001, 128009], tokenizer <|eot_id|> = 128009.

    TensorRT-LLM takes one end_id (the tokenizer's, as its LLM API does); 128001 must travel as a stop word:
    preprocessing's default STOP_WORDS_IDS → the ensemble → tensorrt_llm's stop_words_list.
    """
    import json

    repo = rendered["repo"]
    ids = json.loads((repo / "preprocessing/1/tokenizer/stoker_runtime.json").read_text())
    assert ids == {"end_id": 128009, "stop_ids": [128001], "pad_id": 128009}
    assert (repo / "preprocessing/1/stoker_stop_words.py").is_file()
    pre, ens = _load(repo, "preprocessing"), _load(repo, "ensemble")
    assert "STOP_WORDS_IDS" in {o.name for o in pre.output} and "STOP_WORDS_DICT" in {i.name for i in pre.input}
    steps = {s.model_name: s for s in ens.ensemble_scheduling.step}
    assert steps["preprocessing"].input_map["STOP_WORDS_DICT"] == "stop_words"
    wire = steps["preprocessing"].output_map["STOP_WORDS_IDS"]
    assert steps["tensorrt_llm"].input_map["stop_words_list"] == wire


@pytest.mark.targets("tensorrt")
def test_engine_enables_guided_decoding_with_upstreams_parameters(rendered, ibl):
    """tensorrtllm_backend docs/guided_decoding.md ("C++ Backend"): the C++ backend builds its guided decoder only
    when guided_decoding_backend is xgrammar and xgrammar_tokenizer_info_path names the tokenizer info file; without
    them a guide is not enforced. Both are upstream's parameter names, the file is one the package step writes
    inside the repository (pending at render: no tokenizer here), at the path the serve step mounts it."""
    repo = rendered["repo"]
    params = {k: v.string_value for k, v in _load(repo, "tensorrt_llm").parameters.items()}
    assert {"guided_decoding_backend", "xgrammar_tokenizer_info_path"} <= set(ibl["tensorrt_llm"]["parameters"])
    assert {"guided_decoding_backend", "xgrammar_tokenizer_info_path"} <= set(ibl["tensorrt_llm"]["placeholders"])
    assert params["guided_decoding_backend"] == "xgrammar"
    path = params["xgrammar_tokenizer_info_path"]
    assert path.startswith("/models/tensorrt_llm/1/") and path.endswith(".json")
    assert path.removeprefix("/models/") in rendered["doc"]["repository"]["pending"]
    assert {"guided_decoding_guide_type", "guided_decoding_guide"} <= {t.name for t in _load(repo, "tensorrt_llm").input}


@pytest.mark.targets("pytorch")
def test_llmapi_stops_on_every_eos_id(rendered):
    import json

    repo = rendered["repo"]
    assert json.loads((repo / "tensorrt_llm/1/stoker_stop_ids.json").read_text()) == {"stop_token_ids": [128001]}
    shim = (repo / "tensorrt_llm/1/model.py").read_text()
    compile(shim, "model.py", "exec")
    assert "stop_token_ids" in shim and "get_sampling_params_from_request" in shim


@pytest.mark.targets("pytorch")
def test_llmapi_repository_matches_upstream(rendered, llmapi_layout):
    repo = rendered["repo"]
    up = llmapi_layout["config_pbtxt"]
    cfg = _load(repo, "tensorrt_llm")
    assert cfg.backend == up["backend"] and cfg.max_batch_size == 0
    # Upstream leaves it to auto-complete from model.yaml; stoker declares the same value too, for the ranks of a
    # TP x PP > 1 backend that run without auto-complete (stoker/gpu/llmapi.py).
    doc = yaml.safe_load((repo / "tensorrt_llm/1/model.yaml").read_text())
    assert cfg.model_transaction_policy.decoupled is doc["triton_config"]["decoupled"] is True
    assert _io(cfg.input) == _upstream_io(up["inputs"])
    assert {k: v[0] for k, v in _io(cfg.output).items()} == {k: v[0] for k, v in _upstream_io(up["outputs"]).items()}
    doc = yaml.safe_load((repo / "tensorrt_llm/1/model.yaml").read_text())
    assert set(llmapi_layout["model_yaml"]["top_level_keys"]) <= set(doc)
    assert set(llmapi_layout["model_yaml"]["triton_config_keys"]) <= set(doc["triton_config"])
    assert doc["backend"] == "pytorch" and doc["triton_config"]["max_batch_size"] == 0
    assert doc["triton_config"]["decoupled"] is True  # streaming needs it
    assert doc["model"] == "/models/tensorrt_llm/1/checkpoint"
    assert (repo / "tensorrt_llm/1/model.py").read_text().count("/app/all_models/llmapi/tensorrt_llm/1") == 1


SCORES = {"return_log_probs": ("cum_log_probs", "output_log_probs"), "return_context_logits": ("context_logits",)}
# Upstream's dims (the extracts omit them): per beam, [beam, tokens], [prompt tokens, vocab].
SCORE_DIMS = {"cum_log_probs": [-1], "output_log_probs": [-1, -1], "context_logits": [-1, -1]}


def _check_scores_wiring(ens: mc.ModelConfig, model: mc.ModelConfig, ibl: dict) -> None:
    """Request flags and score outputs: upstream's names and types, passed straight through the ensemble."""
    gen = next(s for s in ens.ensemble_scheduling.step if s.model_name == "tensorrt_llm")
    up_ens_in, up_ens_out = _upstream_io(ibl["ensemble"]["inputs"]), _upstream_io(ibl["ensemble"]["outputs"])
    up_trt_in, up_trt_out = _upstream_io(ibl["tensorrt_llm"]["inputs"]), _upstream_io(ibl["tensorrt_llm"]["outputs"])
    ens_in, trt_in = _io(ens.input), _io(model.input)
    ens_out = {o.name: (mc.DataType.Name(o.data_type), list(o.dims)) for o in ens.output}
    trt_out = {o.name: (mc.DataType.Name(o.data_type), list(o.dims)) for o in model.output}
    for flag, outputs in SCORES.items():
        assert ens_in[flag] == up_ens_in[flag] == ("TYPE_BOOL", True)
        assert trt_in[flag] == up_trt_in[flag]
        assert gen.input_map[flag] == flag
        for name in outputs:
            assert ens_out[name] == (up_ens_out[name][0], SCORE_DIMS[name]), name
            assert trt_out[name] == (up_trt_out[name][0], SCORE_DIMS[name]), name
            assert gen.output_map[name] == name


@pytest.mark.targets("tensorrt")
def test_engine_ensemble_requests_and_returns_log_probs(rendered, ibl):
    repo = rendered["repo"]
    ens = _load(repo, "ensemble")
    _check_scores_wiring(ens, _load(repo, "tensorrt_llm"), ibl)
    assert {o.name for o in ens.output} <= {e["name"] for e in ibl["ensemble"]["outputs"]}


def test_reference_repository_speaks_upstreams_log_prob_interface(ibl):
    """The CPU reference's tensorrt_llm and ensemble: every tensor one of upstream's, with its type and optionality."""
    from stoker.triton import config as triton_config

    cfgs = {c.name: c for c in (triton_config.model(triton_config.RepoSettings()),
                                triton_config.ensemble(triton_config.RepoSettings()))}
    model, ens = cfgs["tensorrt_llm"], cfgs["ensemble"]
    _check_scores_wiring(ens, model, ibl)
    up_trt_in = _upstream_io(ibl["tensorrt_llm"]["inputs"])
    up_trt_out = {k: v[0] for k, v in _upstream_io(ibl["tensorrt_llm"]["outputs"]).items()}
    # Besides upstream's: the reference model's own top-k tensors (top_logprobs), under names upstream does not use.
    own_in = {t[0] for t in triton_config.TOP_LOG_PROBS_IN}
    own_out = {t[0] for t in triton_config.TOP_LOG_PROBS_OUT}
    assert not own_in & set(up_trt_in) and not own_out & set(up_trt_out)
    assert all(up_trt_in[k] == v for k, v in _io(model.input).items() if k not in {"input_ids", *own_in})
    assert all(up_trt_out[k] == v[0] for k, v in _io(model.output).items() if k not in own_out)
    up_ens_out = {k: v[0] for k, v in _upstream_io(ibl["ensemble"]["outputs"]).items()}
    assert all(up_ens_out[k] == v[0] for k, v in _io(ens.output).items())
