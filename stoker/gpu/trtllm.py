"""The container steps of the GPU targets, as data: quantize/convert, trtllm-build, serve.

Every step runs in the *serving* image (spec.deploy.image), so the TRT-LLM that builds an
engine is the one that serves it (serve_command, run by stoker/serving like every backend). Quantization route (both targets): stoker's own worker
(`python3 -m stoker.gpu.quantize_worker`, stoker's source mounted read-only at /stoker)
runs ModelOpt from inside the image — the ModelOpt that TRT-LLM 1.2.1 pins (~=0.37) —
calibrated on an offline text file. It exports
  - the unified HF checkpoint (hf_quant_config.json): what the LLM-API/PyTorch backend
    loads, and the artifact kept for both targets;
  - for the engine target, also a TRT-LLM checkpoint (config.json + rank{i}.safetensors,
    sharded for TP×PP) via export_tensorrt_llm_checkpoint, because trtllm-build 1.2 reads
    only that format. We do not call upstream's examples/quantization/quantize.py: its
    calibration data is a Hub dataset (cnn_dailymail) that offline hosts cannot reach.
Unquantized engine builds use the same worker (format none: no calibration, export only).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .. import target_traits
from ..containers.execute import ContainerStep, Mount
from . import lora, matrix
from .facts import ModelFacts
from .rules import max_seq_len

# Paths inside the container.
C_STOKER = "/stoker"
C_HF = "/workspace/hf"
C_CALIB = "/workspace/calibration.txt"
C_UNIFIED = "/workspace/unified"
C_CKPT = "/workspace/trtllm_checkpoint"
C_ENGINE = "/workspace/engine"
C_TIMING = "/workspace/timing"
C_MODELS = "/models"

# trtllm-build: plugin switches take enable/disable (TRT-LLM's add_plugin_argument), limits take ints.
_ON = {True: "enable", False: "disable"}


@dataclass(frozen=True)
class Workspace:
    """Host folders the steps mount (on the GPU host)."""

    hf: Path  # fetched HF weights (read-only)
    calibration: Path  # offline calibration text file (read-only)
    unified: Path  # quantize output: unified HF checkpoint
    checkpoint: Path  # quantize/convert output: TRT-LLM checkpoint (engine target)
    engine: Path  # trtllm-build output
    timing_cache: Path  # shared across builds: keyed by GPU arch + TRT-LLM inside
    repository: Path  # the Triton model repository
    stoker_src: Path  # the folder holding the `stoker` package


def resolved_dtype(spec, facts: ModelFacts | None) -> str:
    if spec.build.dtype != "auto":
        return spec.build.dtype
    dtype = facts.dtype if facts else "float16"
    return dtype if dtype in ("float16", "bfloat16") else "float16"


def serving_image(spec) -> str:
    """The image every GPU step runs in: tag, plus the digest when the spec pins one."""
    d = spec.deploy
    return f"{d.image}@{d.image_digest}" if d.image_digest else d.image


def needs_quantize_step(spec) -> bool:
    """Engine target: always (a TRT-LLM checkpoint is needed). LLM-API: only to quantize."""
    return builds_engine(spec) or spec.quantization.format != "none"


def builds_engine(spec) -> bool:
    """Whether the build exports a TRT-LLM checkpoint and runs trtllm-build (the target's trait)."""
    return target_traits.of(spec.target).builds_engine


def quantize_argv(spec, facts: ModelFacts | None) -> list[str]:
    q, cal = spec.quantization, spec.quantization.calibration
    argv = ["python3", "-m", "stoker.gpu.quantize_worker", "--model", C_HF, "--format", q.format,
            "--kv-cache-dtype", q.kv_cache_dtype, "--dtype", resolved_dtype(spec, facts),
            "--calib-file", C_CALIB, "--calib-size", str(cal.samples), "--calib-seq-len", str(cal.seq_len),
            "--calib-batch-size", str(cal.batch_size), "--seed", "0"]
    if q.format != "none" and q.kv_cache_dtype != "int8":
        argv += ["--hf-out", C_UNIFIED]
    if builds_engine(spec):
        argv += ["--trtllm-out", C_CKPT, "--tp", str(spec.parallel.tensor), "--pp", str(spec.parallel.pipeline)]
    return argv


def step_names(spec) -> tuple[str, ...]:
    """The container steps a build runs, in order (gpu_steps' names): what stoker/gpu/placement.py sizes."""
    names = ()
    if needs_quantize_step(spec) and spec.build.engine_dir is None:
        names += ("quantize" if spec.quantization.format != "none" else "checkpoint",)
    if builds_engine(spec) and spec.build.engine_dir is None:
        names += ("build",)
    return names


def step_argvs(spec, facts: ModelFacts | None = None) -> list[list[str]]:
    """The command of every container step a build runs (gpu_steps' argv), in order: what its cache key holds."""
    argvs = [quantize_argv(spec, facts)] if needs_quantize_step(spec) and spec.build.engine_dir is None else []
    if builds_engine(spec) and spec.build.engine_dir is None:
        argvs.append(build_argv(spec, facts))
    return argvs


def timing_cache_name(spec) -> str:
    """One cache per GPU architecture and TRT-LLM: TensorRT tactics do not transfer across either."""
    gpu = matrix.gpu_info(spec.gpus.type)
    img = matrix.image_info(spec.deploy.image)
    return f"{gpu.arch if gpu else 'unknown'}-trtllm{img.trtllm if img else 'unknown'}.cache"


def build_argv(spec, facts: ModelFacts | None) -> list[str]:
    """trtllm-build for TRT-LLM 1.2: only flags its parser accepts; none of the removed 2024-era ones
    (no --max_output_len, --tp_size/--pp_size: parallelism is fixed in the checkpoint)."""
    b = spec.build
    timing = f"{C_TIMING}/{timing_cache_name(spec)}"
    argv = ["trtllm-build", "--checkpoint_dir", C_CKPT, "--output_dir", C_ENGINE,
            "--max_batch_size", str(b.max_batch_size), "--max_input_len", str(b.max_input_len)]
    seq = max_seq_len(spec, facts)
    if seq is not None:
        argv += ["--max_seq_len", str(seq)]
    argv += ["--max_num_tokens", str(b.max_num_tokens)]
    if b.opt_num_tokens is not None:
        argv += ["--opt_num_tokens", str(b.opt_num_tokens)]
    argv += ["--max_beam_width", str(b.max_beam_width), "--kv_cache_type", b.kv_cache_type,
             "--tokens_per_block", str(b.tokens_per_block),
             "--gpt_attention_plugin", b.gpt_attention_plugin, "--gemm_plugin", b.gemm_plugin,
             "--remove_input_padding", _ON[b.remove_input_padding], "--context_fmha", _ON[b.context_fmha],
             "--use_paged_context_fmha", _ON[b.use_paged_context_fmha and b.kv_cache_type == "paged"],
             "--use_fp8_context_fmha", _ON[b.use_fp8_context_fmha],
             "--multiple_profiles", _ON[b.multiple_profiles],
             *(["--gather_context_logits"] if b.gather_context_logits else []),
             "--workers", str(min(b.workers, spec.parallel.world_size)),
             "--input_timing_cache", timing, "--output_timing_cache", timing, "--log_level", "info",
             *lora.build_flags(spec, facts.model_type if facts else "")]
    return argv


def serve_command(spec, ports, extra_args: list[str], complete_configs: bool = False) -> list[str]:
    """The serving container's command on ``ports`` (chosen by stoker/serving: loopback, host network), as the
    one serving path runs it for every backend of a GPU target; ``extra_args`` (Triton's restricted admin APIs)
    go to every tritonserver process.

    One GPU: tritonserver on the mounted repository. TP×PP > 1: one MPI rank per GPU (what TensorRT-LLM's
    launch_triton_server.py starts, written out so each rank gets loopback addresses and the restricted APIs):
    rank 0 loads every model and serves; the other ranks load only tensorrt_llm and stay inside the backend's
    worker loop, so they never reach the point of binding the ports. deploy.openai is stoker's OpenAI service, a
    container of its own (stoker/gpu/openai_frontend.py says why not Triton's frontend).

    ``complete_configs``: every config.pbtxt of the repository is complete (the engine layout, as upstream's
    launch_triton_server.py assumes), so one process runs without auto-complete too, as every rank does: each
    auto-completed python model costs one more stub start.
    """
    world = spec.parallel.world_size
    common = ["--http-address=127.0.0.1", f"--http-port={ports.http}", "--grpc-address=127.0.0.1",
              f"--grpc-port={ports.grpc}", "--metrics-address=127.0.0.1", f"--metrics-port={ports.metrics}",
              *extra_args]
    if world == 1:
        return ["tritonserver", f"--model-repository={C_MODELS}", *common,
                *(["--disable-auto-complete-config"] if complete_configs else [])]
    argv = ["mpirun", "--allow-run-as-root"]
    for rank in range(world):
        only_engine = ["--model-control-mode=explicit", "--load-model=tensorrt_llm"] if rank else []
        argv += ["-n", "1", "tritonserver", f"--model-repository={C_MODELS}", *only_engine, *common,
                 "--disable-auto-complete-config", f"--backend-config=python,shm-region-prefix-name=prefix{rank}_"]
        if rank < world - 1:
            argv.append(":")
    return argv


def _gpu_base(spec, name: str, argv: list[str], mounts: list[Mount], timeout_s: float) -> ContainerStep:
    d = spec.deploy
    return ContainerStep(name=name, image=serving_image(spec), argv=argv, mounts=mounts,
                         env={"PYTHONPATH": C_STOKER, "PYTHONUNBUFFERED": "1"}, workdir="/workspace",
                         gpus=spec.gpus.ids[:spec.parallel.world_size], shm_size=d.shm_size,
                         ulimits={k: (v.soft, v.hard) for k, v in d.ulimits.items()}, timeout_s=timeout_s)


def gpu_steps(spec, facts: ModelFacts | None, ws: Workspace) -> list[ContainerStep]:
    """The container steps that build on a GPU host, in order; serving is stoker/serving's (serve_command)."""
    steps: list[ContainerStep] = []
    argvs = step_argvs(spec, facts)
    if needs_quantize_step(spec) and spec.build.engine_dir is None:
        mounts = [Mount(str(ws.stoker_src), C_STOKER), Mount(str(ws.hf), C_HF),
                  Mount(str(ws.calibration), C_CALIB), Mount(str(ws.unified), C_UNIFIED, False)]
        if builds_engine(spec):
            mounts.append(Mount(str(ws.checkpoint), C_CKPT, False))
        name = "quantize" if spec.quantization.format != "none" else "checkpoint"
        # A token is only needed to fetch; the weights are mounted, so no secret goes in.
        steps.append(_gpu_base(spec, name, argvs[0], mounts, 4 * 3600))
    if builds_engine(spec) and spec.build.engine_dir is None:
        mounts = [Mount(str(ws.checkpoint), C_CKPT), Mount(str(ws.engine), C_ENGINE, False),
                  Mount(str(ws.timing_cache), C_TIMING, False)]
        steps.append(_gpu_base(spec, "build", argvs[-1], mounts, 4 * 3600))
    return steps
