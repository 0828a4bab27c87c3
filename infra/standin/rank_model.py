"""STAND-IN, NOT TensorRT-LLM: the rank rule of an MPI-launched TensorRT-LLM model, around stoker's reference model.

Installed by stoker/stack/standin_image.py as the ``model.py`` of the stand-in's ``tensorrtllm`` backend and of its
LLM-API model, with the reference model it wraps beside it as ``stoker_reference_model.py``. The reference code is
run in this module's own namespace, so this module *is* the reference model (its functions, its
TritonPythonModel) plus one rule; stoker's llmapi shim, which replaces a module function
(get_sampling_params_from_request), replaces the one the model calls.

The rule, as TensorRT-LLM's Triton model behaves under ``mpirun`` (stoker/gpu/trtllm.py serve_command starts one
tritonserver per rank): rank 0 (OMPI_COMM_WORLD_RANK, set by mpirun) loads and serves. Every other rank enters the
worker loop inside initialize and never returns from it, so its tritonserver never finishes loading and never binds
a port. Upstream: triton_backend/all_models/inflight_batcher_llm/tensorrt_llm/1/model.py (NVIDIA/TensorRT-LLM;
tensorrtllm_backend before it), TritonPythonModel.initialize: when the executor cannot enqueue requests (a worker
rank in leader mode) it calls executor.shutdown(), where "worker ranks will wait here until leader is done". The stand-in gives its LLM-API model (target: pytorch) the same rule; how
TensorRT-LLM's own LLM API spreads its ranks under this command was not checked here. The stand-in's worker rank
holds no weights: stoker's reference runtime computes the whole model on rank 0, so a shard would only cost memory.
"""

import os
import threading

_HERE = os.path.dirname(os.path.abspath(__file__))
_REFERENCE = os.path.join(_HERE, "stoker_reference_model.py")
with open(_REFERENCE, encoding="utf-8") as _fh:  # the locale of a stub may be ASCII
    exec(compile(_fh.read(), _REFERENCE, "exec"))  # noqa: S102 - the reference model, in this namespace (above)

_RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
_WORLD = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
_reference_initialize = TritonPythonModel.initialize  # noqa: F821 - defined by the reference model's code


def _initialize_by_rank(self, args):
    if _RANK == 0:
        return _reference_initialize(self, args)
    print(f"STAND-IN rank {_RANK} of {_WORLD}: in the worker loop (as TensorRT-LLM's worker ranks); "
          "rank 0 serves", flush=True)
    threading.Event().wait()  # never set: the worker loop ends with the process (mpirun ends the job)


TritonPythonModel.initialize = _initialize_by_rank  # noqa: F821
