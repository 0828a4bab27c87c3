from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from stoker.triton import config as tc
from stoker.triton.config import RepoSettings

POSTPROCESSING = '''name: "postprocessing"
max_batch_size: 4
input {
  name: "TOKENS_BATCH"
  data_type: TYPE_INT32
  dims: -1
  dims: -1
}
input {
  name: "SEQUENCE_LENGTH"
  data_type: TYPE_INT32
  dims: -1
}
output {
  name: "OUTPUT"
  data_type: TYPE_STRING
  dims: -1
}
instance_group {
  count: 3
  kind: KIND_CPU
}
dynamic_batching {
}
parameters {
  key: "skip_special_tokens"
  value {
    string_value: "true"
  }
}
parameters {
  key: "tokenizer_dir"
  value {
    string_value: "tokenizer"
  }
}
backend: "python"
'''


def test_postprocessing_renders_exactly():
    s = RepoSettings(max_batch_size=4, postprocessing_instances=3)
    assert tc.render(tc.postprocessing(s)) == POSTPROCESSING


def _parsed(settings=RepoSettings()):
    return {name: text_format.Parse(text, mc.ModelConfig()) for name, text in tc.render_all(settings).items()}


def test_every_config_round_trips_through_tritons_protobuf_and_has_no_placeholders():
    for name, text in tc.render_all(RepoSettings(max_batch_size=16)).items():
        assert "${" not in text
        cfg = text_format.Parse(text, mc.ModelConfig())
        assert cfg.name == name and cfg.max_batch_size == 16


def test_model_step_is_decoupled_and_python_with_upstream_tensor_names():
    cfg = _parsed()["tensorrt_llm"]
    assert cfg.backend == "python" and cfg.model_transaction_policy.decoupled
    inputs = {i.name: (mc.DataType.Name(i.data_type), i.optional) for i in cfg.input}
    assert inputs["input_ids"] == ("TYPE_INT32", False)
    assert inputs["input_lengths"] == ("TYPE_INT32", False)
    assert inputs["request_output_len"] == ("TYPE_INT32", False)
    assert inputs["streaming"] == ("TYPE_BOOL", True)
    assert inputs["runtime_top_k"] == ("TYPE_INT32", True)
    assert inputs["seed"] == ("TYPE_UINT64", True)
    outputs = {o.name: (mc.DataType.Name(o.data_type), list(o.dims)) for o in cfg.output}
    assert outputs == {"output_ids": ("TYPE_INT32", [-1, -1]), "sequence_length": ("TYPE_INT32", [-1]),
                       "cum_log_probs": ("TYPE_FP32", [-1]), "output_log_probs": ("TYPE_FP32", [-1, -1]),
                       "context_logits": ("TYPE_FP32", [-1, -1]),
                       # the reference model's own (top_logprobs): not TensorRT-LLM's, not in the ensemble
                       "top_log_prob_ids": ("TYPE_INT32", [-1, -1]), "top_log_probs": ("TYPE_FP32", [-1, -1])}
    assert inputs["return_top_log_probs"] == ("TYPE_INT32", True)
    assert not {"top_log_probs", "top_log_prob_ids"} & {o.name for o in _parsed()["ensemble"].output}
    assert inputs["return_log_probs"] == ("TYPE_BOOL", True)
    assert inputs["return_context_logits"] == ("TYPE_BOOL", True)
    assert cfg.parameters["gpt_model_path"].string_value == "weights"


def test_ensemble_wiring_is_closed():
    """Every step input comes from an ensemble input or an earlier step's output, with matching types."""
    cfgs = _parsed()
    ens = cfgs["ensemble"]
    assert ens.platform == "ensemble"
    available = {i.name: i.data_type for i in ens.input}
    for step in ens.ensemble_scheduling.step:
        model = cfgs[step.model_name]
        model_inputs = {i.name: i for i in model.input}
        for model_in, ens_tensor in step.input_map.items():
            assert model_in in model_inputs, (step.model_name, model_in)
            assert ens_tensor in available, (step.model_name, ens_tensor)
            assert available[ens_tensor] == model_inputs[model_in].data_type
        # every required model input is fed
        for name, spec in model_inputs.items():
            assert spec.optional or name in step.input_map, (step.model_name, name)
        model_outputs = {o.name: o.data_type for o in model.output}
        for model_out, ens_tensor in step.output_map.items():
            available[ens_tensor] = model_outputs[model_out]
    assert {o.name for o in ens.output} <= set(available)
    gen = next(s for s in ens.ensemble_scheduling.step if s.model_name == "tensorrt_llm")
    assert gen.input_map["streaming"] == "stream"
    assert gen.input_map["runtime_top_p"] == "top_p"


def test_instance_counts_and_batch_size_come_from_settings():
    cfgs = _parsed(RepoSettings(max_batch_size=2, preprocessing_instances=2, model_instances=3))
    assert cfgs["preprocessing"].instance_group[0].count == 2
    assert cfgs["tensorrt_llm"].instance_group[0].count == 3
    assert cfgs["tensorrt_llm"].instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU
    assert all(c.max_batch_size == 2 for c in cfgs.values())


def test_ensemble_passes_the_log_prob_flags_and_returns_the_outputs():
    """TensorRT-LLM's ensemble: the request flags go through unchanged, the outputs come back under the same names."""
    cfgs = _parsed()
    ens, model = cfgs["ensemble"], cfgs["tensorrt_llm"]
    gen = next(s for s in ens.ensemble_scheduling.step if s.model_name == "tensorrt_llm")
    for flag in ("return_log_probs", "return_context_logits"):
        assert gen.input_map[flag] == flag
        assert next(i for i in ens.input if i.name == flag).optional
    model_out = {o.name: (o.data_type, list(o.dims)) for o in model.output}
    ens_out = {o.name: (o.data_type, list(o.dims)) for o in ens.output}
    for name in ("cum_log_probs", "output_log_probs", "context_logits"):
        assert gen.output_map[name] == name
        assert ens_out[name] == model_out[name]
