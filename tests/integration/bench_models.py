"""Triton model sources shared by the benchmark integration tests."""

# Non-decoupled, like TensorRT-LLM's backend deployed without decoupled mode: it refuses stream=true.
UNARY_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(error=pb_utils.TritonError(
            "Streaming is only supported if model is deployed using decoupled mode.")) for _ in requests]
"""
UNARY_CONFIG = """
name: "unary_llm"
backend: "python"
max_batch_size: 8
input [
  { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "stream" data_type: TYPE_BOOL dims: [ 1 ] optional: true }
]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] } ]
"""
