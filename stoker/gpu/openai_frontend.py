"""Triton's own OpenAI-compatible frontend: why it is not the serve command, and the command it would be.

Rendered by contract, not run here (no GPU, no TensorRT-LLM, no NGC image on stoker's machines).
The CPU reference path has stoker's own OpenAI service (stoker.serving.openai_service); GPU images
ship NVIDIA's, which this module renders instead. Pure: spec in, argv / ports / findings out.

Upstream facts this relies on (triton-inference-server/server; 26.07 = tag v2.71.0,
commit 819ee37770df2fcd6d799d2a5d1dacf812f7d62c, per build.py's DEFAULT_TRITON_VERSION_MAP):
- build.py copies python/openai into the image at /opt/tritonserver/python/openai and pip-installs
  its requirements.txt. Added by b3b886bc5ad69ac246f5a164884e7caf2de3af62 ("Add OpenAI-Compatible
  Server to NGC Container", #7895), first released in v2.53.0 (1efbd53bd538b139e471cf8b94291dd820f78c70)
  = the 24.12 images.
- python/openai/openai_frontend/main.py starts Triton *in its own process* (tritonserver.Server with
  --model-repository), so it replaces `tritonserver` as the container's command: a second container
  beside tritonserver would load the engine a second time. KServe HTTP/gRPC come from the same process
  only with --enable-kserve-frontends (--kserve-http-port 8000, --kserve-grpc-port 8001 by default);
  the OpenAI API listens on --openai-port (default 9000) at --host (default 0.0.0.0). It starts no
  metrics frontend: Prometheus text is served at GET /metrics of the OpenAI port, readiness at
  GET /health/ready (frontend/fastapi/routers/observability.py). --backend tensorrtllm forces the
  TRT-LLM request format (choices: vllm, tensorrtllm).
- engine/triton_engine.py lists every ready model under its Triton name; a request picks one by name.
  engine/utils/triton.py builds TRT-LLM requests with the inflight_batcher_llm ensemble's inputs
  (text_input, max_tokens, stream, stop_words, top_p, temperature, seed, presence/frequency_penalty)
  and always return_num_input_tokens/return_num_output_tokens. The llmapi model takes other names
  (streaming, sampling_param_*), so the pytorch target gets no frontend.
- python/openai/README.md: for TRT-LLM the model is "ensemble" (or "tensorrt_llm_bls"); more than one
  GPU works only in orchestrator mode (TRTLLM_ORCHESTRATOR=1), not in leader mode, which is how
  stoker launches TP x PP > 1 (mpirun, one rank per GPU, as launch_triton_server.py does).
Unverified: the README's TRT-LLM section still tells users to pip-install the wheels and clone the
repository inside the -trtllm-python-py3 image; that its copy at /opt/tritonserver/python/openai runs
there as is follows from build.py only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from . import matrix

# Spec validation reaches this module through rules.py: no protobuf/tritonclient import here, so the
# two names below repeat stoker.triton.config's (a unit test keeps them equal).
FIRST_TAG = "24.12"  # the first NGC release whose images carry the frontend (v2.53.0)
MAIN = "/opt/tritonserver/python/openai/openai_frontend/main.py"
PORT = 9000  # upstream's --openai-port default, inside the container
MODEL_NAME = "ensemble"  # what an OpenAI client names as `model`: the ensemble is the model that takes text
C_MODELS = "/models"  # where the serve step mounts the repository (stoker.gpu.trtllm.C_MODELS)
# The build's tokenizer files, as the package step copies them for preprocessing (stoker.gpu.repository).
TOKENIZER_DIR = f"{C_MODELS}/preprocessing/1/tokenizer"


@dataclass(frozen=True)
class Finding:
    level: Literal["refuse", "note"]
    message: str


def ships_frontend(image: str) -> bool:
    """Whether the image (matrix.json's NGC -trtllm-python-py3 series) carries the frontend."""
    info = matrix.image_info(image)
    return info is not None and info.tag is not None and info.tag >= FIRST_TAG


def findings(spec) -> list[Finding]:
    """What `deploy.openai` means for this GPU spec: stoker's OpenAI service, and why not Triton's frontend."""
    if not spec.deploy.openai:
        return []
    return [Finding("note", "stoker's OpenAI service (a container of stoker/triton-cpu, built here by `stoker image`) "
                            "serves /v1/ in front of the backend, speaking the target's interface; Triton's own "
                            "frontend is not the serve command: its KServe endpoints cannot restrict Triton's admin "
                            "APIs")]


def renders(spec) -> bool:
    """Never, since every serve command must restrict Triton's admin APIs with the backend's token: Triton's frontend
    (main.py, up to 26.07) starts its KServe HTTP/gRPC endpoints without restricted APIs (only its OpenAI routes take
    --openai-restricted-api), and stoker's probes, benchmark and evaluation need those endpoints. `argv` is kept as
    the recorded command, should a release restrict them."""
    return False


def argv(kserve_http: int, kserve_grpc: int, openai_port: int = PORT, host: str = "127.0.0.1") -> list[str]:
    """The serve container's command: Triton with the OpenAI API and KServe HTTP/gRPC, one process.

    KServe keeps stoker's readiness probe (/v2/health/ready), benchmark and evaluation working
    unchanged; the tokenizer is the build's own, the one preprocessing tokenizes with, so chat
    templates and token counts match what the ensemble serves. stoker/serving runs it on a backend's ports
    (the OpenAI port takes the metrics role: the same Prometheus text is at its /metrics), on loopback:
    clients reach it through the deployment's proxy.
    """
    return ["python3", MAIN, "--model-repository", C_MODELS, "--tokenizer", TOKENIZER_DIR,
            "--backend", "tensorrtllm", "--host", host, "--openai-port", str(openai_port),
            "--enable-kserve-frontends", "--kserve-http-port", str(kserve_http),
            "--kserve-grpc-port", str(kserve_grpc)]
