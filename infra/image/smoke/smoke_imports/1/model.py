"""Build-time smoke model: proves the python backend stub sees the venv's packages."""
import numpy as np
import safetensors
import tokenizers
import torch
import transformers
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        versions = f"torch={torch.__version__} numpy={np.__version__} " \
                   f"safetensors={safetensors.__version__} tokenizers={tokenizers.__version__} " \
                   f"transformers={transformers.__version__}"
        responses = []
        for request in requests:
            x = torch.from_numpy(pb_utils.get_input_tensor_by_name(request, "X").as_numpy())
            total = np.array([float(x.sum())], dtype=np.float32)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("SUM", total),
                pb_utils.Tensor("VERSIONS", np.array([versions.encode()], dtype=np.object_)),
            ]))
        return responses
