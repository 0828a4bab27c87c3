"""The quantize worker on real GPUs: peak memory per GPU, time and checkpoint size, against stoker/gpu/memory.py's
estimate and against ModelOpt alone (benchmarks/gpu_bare_modelopt.py).

On the GPU machine (two GPUs, no network; benchmarks/gpu_quantize.sh installs the wheels and calls this):

    python3 benchmarks/gpu_quantize.py device --out $OUT --tokenizer build/tok [--budget-s 560] [--one-gpu]

makes a Llama-3-8B-shaped model with random weights on the GPU (bf16, saved to /tmp with the tiny tokenizer's
files: every id stays far below the 128,256-entry vocabulary), compiles ModelOpt's CUDA extensions once, then runs
for fp8, nvfp4 and int4_awq: stoker's worker on one GPU beside the bare script on the other (same calibration,
same moment, so the ratio sees the same machine), then stoker's worker spanning both GPUs (--tp 2). nvidia-smi is
sampled every 200 ms; each process also reports torch.cuda.max_memory_reserved. Raw records go to
$OUT/gpu_quantize_raw.json after every step, so a run cut short keeps what it measured.

With --one-gpu (a machine of one GPU, e.g. kind nvidia-h100-x1) the same model, extensions and calibration, but
every process alone on GPU 0, one after the other: per format stoker's worker and the bare script (which goes first
alternates between formats), fp8, int4_awq, then nvfp4 (the first dropped when the budget runs short); no --tp 2.
Here, afterwards:

    python3 benchmarks/gpu_quantize.py report RAW.json [RAW.json …]   # → benchmarks/results/gpu_quantize.json
    python3 benchmarks/gpu_quantize.py report --section h100_one_gpu RAW.json   # adds/replaces that section only

The `make-model` and `context` commands are the device run's own child processes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = Path("/tmp/llama3-8b-random")
WORK = Path("/tmp/gpu_quantize")
CALIB_FILE = ROOT / "stoker" / "data" / "calibration.txt"
CALIB = {"size": 16, "seq_len": 128, "batch_size": 4}
# Meta-Llama-3-8B's config.json shapes (hidden, layers, GQA 32/8, 128k vocabulary, untied lm_head).
LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
             "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
FORMATS = ("fp8", "nvfp4", "int4_awq")  # int4_awq last: its AWQ search is the slowest
ONE_GPU_FORMATS = ("fp8", "int4_awq", "nvfp4")  # nvfp4 (export only on Hopper) last: the first to drop
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def smi(query: str) -> list[list[str]]:
    out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return [[c.strip() for c in line.split(",")] for line in out.strip().splitlines()]


class Sampler:
    """nvidia-smi's memory.used of every GPU every 200 ms; keeps the highest reading per GPU index."""

    def __init__(self) -> None:
        self.peak: dict[int, int] = {}
        self.samples = 0
        self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits",
                                      "-lms", "200"], stdout=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                idx, used = (int(x) for x in line.split(","))
            except ValueError:
                continue
            self.peak[idx] = max(self.peak.get(idx, 0), used)
            self.samples += 1

    def stop(self) -> dict[int, int]:
        time.sleep(0.5)  # one more reading after the processes ended
        self.proc.terminate()
        self.proc.wait()
        self.thread.join(timeout=2)
        return dict(self.peak)


def make_model(out: Path, tokenizer: Path, shape: dict = LLAMA3_8B, where: str = "cuda") -> None:
    """Random bf16 weights straight on the GPU (no 32 GB float32 init), saved as a normal HF checkpoint."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, dtype="bfloat16")
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(where):
        model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            shutil.copyfile(tokenizer / name, out / name)
    print(json.dumps({"params": sum(p.numel() for p in model.parameters()),
                      "bytes_on_disk": sum(f.stat().st_size for f in out.iterdir())}))


def context() -> None:
    """An otherwise empty process: torch, ModelOpt and its CUDA extensions loaded, one bf16 matmul; holds 2 s."""
    import modelopt.torch.quantization as mtq  # noqa: F401
    import torch
    from modelopt.torch.quantization import extensions

    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    (x @ x).sum().item()
    loaded = [bool(f()) for f in (extensions.get_cuda_ext, extensions.get_cuda_ext_fp8, extensions.get_cuda_ext_mx)]
    torch.cuda.synchronize()
    print(json.dumps({"reserved_mib": torch.cuda.memory_reserved(0) >> 20, "extensions_loaded": loaded}), flush=True)
    time.sleep(2)


def _case(tool: str, fmt: str, gpus: list[int]) -> dict:
    name = f"{tool}-{fmt}-{len(gpus)}gpu"
    out = WORK / name
    cal = ["--calib-file", str(CALIB_FILE), "--calib-size", str(CALIB["size"]), "--calib-seq-len",
           str(CALIB["seq_len"]), "--calib-batch-size", str(CALIB["batch_size"])]
    if tool == "stoker":
        argv = [sys.executable, "-W", "ignore", "-m", "stoker.gpu.quantize_worker", "--model", str(MODEL_DIR),
                "--format", fmt, "--kv-cache-dtype", "none", "--dtype", "bfloat16", *cal, "--device", "cuda",
                "--trtllm-out", str(out), "--tp", str(len(gpus)), "--pp", "1"]
    else:
        argv = [sys.executable, "-W", "ignore", str(ROOT / "benchmarks" / "gpu_bare_modelopt.py"), "--model",
                str(MODEL_DIR), "--format", fmt, *cal, "--out", str(out)]
    return {"name": name, "tool": tool, "format": fmt, "gpus": len(gpus), "gpu_indices": gpus, "argv": argv,
            "out": out}


def plan(one_gpu: bool = False, swap: bool = False) -> list[list[dict]]:
    """Steps of processes that run at the same time: one format's stoker and bare runs side by side (alternating
    which GPU each gets), then stoker on both GPUs. One GPU: each process is a step of its own on GPU 0, a format's
    stoker and bare runs back to back (stoker first for fp8 and nvfp4, bare first for int4_awq; `swap` turns every
    pair round, for a second run that sees each order); a pair's first step carries `pair_s`, the time left it needs
    to start, so a format is measured whole or not at all."""
    steps = []
    if one_gpu:
        for k, fmt in enumerate(ONE_GPU_FORMATS):
            pair = [_case("stoker", fmt, [0]), _case("bare", fmt, [0])]
            if k % 2 != swap:
                pair.reverse()
            pair[0]["pair_s"] = 100 if fmt == "int4_awq" else 75
            steps += [[c] for c in pair]
        return steps
    for k, fmt in enumerate(FORMATS):
        mine, bare = (0, 1) if k % 2 == 0 else (1, 0)
        steps.append([_case("stoker", fmt, [mine]), _case("bare", fmt, [bare])])
        steps.append([_case("stoker", fmt, [0, 1])])
    return steps


def _last_json(text: str) -> dict | None:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def run_step(cases: list[dict], idle: dict[int, int], deadline: float, logs: Path) -> list[dict]:
    """Start the step's processes together, note when each ends, read the GPUs' peaks over the whole step."""
    sampler = Sampler()
    running = []
    for c in cases:
        shutil.rmtree(c["out"], ignore_errors=True)
        env = {**os.environ, **NO_MULTICAST, "CUDA_VISIBLE_DEVICES": ",".join(map(str, c["gpu_indices"])),
               "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
        # stdout to a file too: ModelOpt prints a lot there, and a full pipe would stall the child.
        with open(logs / f"{c['name']}.out", "w") as out, open(logs / f"{c['name']}.log", "w") as err:
            running.append({"c": c, "proc": subprocess.Popen(c["argv"], cwd=ROOT, env=env, stdout=out, stderr=err),
                            "started": time.monotonic(), "ended": None, "timed_out": False})
    while any(r["ended"] is None for r in running):
        for r in running:
            if r["ended"] is None and r["proc"].poll() is not None:
                r["ended"] = time.monotonic()
            elif r["ended"] is None and time.monotonic() > deadline:
                r["proc"].kill()
                r["proc"].wait()
                r["ended"], r["timed_out"] = time.monotonic(), True
        time.sleep(0.1)
    peak = sampler.stop()
    out = []
    for r in running:
        c = r["c"]
        size = sum(f.stat().st_size for f in c["out"].rglob("*") if f.is_file()) if c["out"].is_dir() else 0
        shutil.rmtree(c["out"], ignore_errors=True)  # 6-9 GB each: the disk holds a few at most
        out.append({k: c[k] for k in ("name", "tool", "format", "gpus", "gpu_indices")} | {
            "rc": r["proc"].returncode, "timed_out": r["timed_out"], "wall_s": round(r["ended"] - r["started"], 1),
            "peak_used_mib": {str(g): peak.get(g) for g in c["gpu_indices"]},
            "peak_over_idle_mib": {str(g): peak.get(g, 0) - idle.get(g, 0) for g in c["gpu_indices"]},
            "result": _last_json((logs / f"{c['name']}.out").read_text()), "export_bytes": size,
            "side_by_side_with": [o["c"]["name"] for o in running if o is not r],
            "stderr_tail": (logs / f"{c['name']}.log").read_text()[-1500:]})
    return out


def device(out_dir: Path, tokenizer: Path, budget_s: float, steps: set[int] | None = None,
           one_gpu: bool = False, swap: bool = False) -> None:
    t_start = time.monotonic()
    deadline = t_start + budget_s
    WORK.mkdir(parents=True, exist_ok=True)
    logs = WORK / "logs"
    logs.mkdir(exist_ok=True)
    raw: dict = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "calibration": CALIB,
                 "model": {"shape": "Llama-3-8B", "config": LLAMA3_8B, "weights": "random normal, bf16"},
                 "gpus": [dict(zip(("index", "name", "memory_total_mib", "driver"), row))
                          for row in smi("index,name,memory.total,driver_version")], "runs": [], "skipped": [],
                 "mode": ("one GPU, one process at a time" + (", pairs swapped" if swap else "")) if one_gpu
                 else "two GPUs, stoker beside bare"}
    raw["idle_used_mib"] = {row[0]: int(row[1]) for row in smi("index,memory.used")}
    idle = {int(k): v for k, v in raw["idle_used_mib"].items()}
    env = {**os.environ, **NO_MULTICAST, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    versions = subprocess.run([sys.executable, "-c", "import sys, json, torch, transformers, modelopt, accelerate; "
                               "print(json.dumps({'python': sys.version.split()[0], "
                               "'torch': torch.__version__, 'transformers': transformers.__version__, "
                               "'modelopt': modelopt.__version__, 'accelerate': accelerate.__version__, "
                               "'cuda': torch.version.cuda}))"], capture_output=True, text=True, env=env)
    raw["versions"] = _last_json(versions.stdout) or {"error": versions.stderr[-500:]}

    def save() -> None:
        (out_dir / "gpu_quantize_raw.json").write_text(json.dumps(raw, indent=1))

    save()
    # ModelOpt compiles its CUDA extensions on first use (40-47 s each on an H200): once, here, in parallel with
    # making the model, so no timed run pays for it.
    t = time.monotonic()
    compiles = [subprocess.Popen([sys.executable, "-c", f"from modelopt.torch.quantization import extensions as e; "
                                  f"print(e.{fn}() is not None)"], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
                for fn in ("get_cuda_ext", "get_cuda_ext_fp8", "get_cuda_ext_mx")]
    made = subprocess.run([sys.executable, __file__, "make-model", "--out", str(MODEL_DIR), "--tokenizer",
                           str(tokenizer)], env={**env, "CUDA_VISIBLE_DEVICES": "0"}, capture_output=True, text=True)
    raw["make_model"] = {"rc": made.returncode, "s": round(time.monotonic() - t, 1),
                         "result": _last_json(made.stdout), "stderr_tail": made.stderr[-1500:]}
    raw["extensions"] = [{"out": p.communicate()[0][-400:], "rc": p.returncode} for p in compiles]
    raw["setup_s"] = round(time.monotonic() - t, 1)
    save()
    if made.returncode != 0:
        return
    sampler = Sampler()
    ctx = subprocess.run([sys.executable, __file__, "context"], env={**env, "CUDA_VISIBLE_DEVICES": "0"},
                         capture_output=True, text=True)
    peak = sampler.stop()
    result = _last_json(ctx.stdout) or {}
    raw["context"] = {"rc": ctx.returncode, "peak_over_idle_mib": peak.get(0, 0) - idle.get(0, 0), **result,
                      "stderr_tail": ctx.stderr[-800:]}
    save()
    skip_next = False
    for k, step in enumerate(plan(one_gpu, swap)):
        if steps is not None and k not in steps:
            continue
        left = deadline - time.monotonic()
        need = max([45] + [c.get("pair_s", 0) for c in step])
        if left < need or (skip_next and not any("pair_s" in c for c in step)):
            raw["skipped"] += [{"name": c["name"], "why": f"device budget spent ({budget_s:.0f} s)"} for c in step]
            skip_next = any("pair_s" in c for c in step)
            continue
        skip_next = False
        raw["runs"] += [rec | {"step": k} for rec in run_step(step, idle, deadline, logs)]
        save()
    raw["total_s"] = round(time.monotonic() - t_start, 1)
    save()
    with open(out_dir / "gpu_quantize_device.log", "w") as f:
        for log in sorted(logs.iterdir()):
            f.write(f"===== {log.name}\n{log.read_text()[-20000:]}\n")


# ---------------------------------------------------------------------------------------------- report (here)

NOT_MEASURED = [
    "Two H100s: three device calls (two sessions) asked for kind nvidia-h100-x2 and were served two H200s each (the tool may substitute; the third run, 2026-11-28 05:5x UTC, reproduced every peak here to the MiB and was not committed). "
    "One H100 (kind nvidia-h100-x1) is measured in sections.h100_one_gpu: the same peaks to the MiB as here.",
    "NVFP4 inference: Hopper (sm_90) has no FP4 kernels; nvfp4 ran quantize + export only (the checkpoint serves on "
    "Blackwell).",
    "The unified HF checkpoint (--hf-out), which stoker's pipeline also writes for every quantized format "
    "(stoker/gpu/trtllm.py quantize_argv): not run; memory.py models the TRT-LLM export, which by ModelOpt's code "
    "(export/unified_export_hf.py packs module by module in place) needs more.",
    "FP8/INT8 KV-cache quantization (kv none here), stoker's default calibration (512 × 512 tokens, batch 8: the "
    "logits term, 1 GiB there, is not checked against a measurement), real (non-random) weights.",
    "More than 2 GPUs and 70B-sized models (no device time left for them). memory.split reproduces, offline on a "
    "meta-device model, transformers 5.17's and 5.23's device maps (with Accelerate 1.15) for Llama-3-8B on 2, 4 "
    "and 8 GPUs and for an 80-layer variant on 2; the memory of those placements is not measured.",
    "ModelOpt alone spanning 2 GPUs: the bare script is the one-GPU baseline only.",
    "The worker inside the TRT-LLM serving image (ModelOpt ~0.37 there): these runs carried ModelOpt 0.47 wheels.",
]
FIRST_ESTIMATE = (
    "The first version of memory.py (commit eeae63b) over-estimated by 1.35× on one GPU: it counted a 16-bit "
    "gate|up copy of every layer in the export (merge_gate_fc), which ModelOpt makes only for MoE shared experts. "
    "memory.py was corrected from ModelOpt's code after the first device run (per-format packing copies from "
    "quant_utils.to_quantized_weight, calibration and export working sets added since nothing empties the "
    "allocator's cache, transformers 5.17's balanced map); the second run, on another machine, measured the same "
    "peaks to the MiB, so the ratios below are of an estimate written after seeing the first run's numbers.")


H100_NOT_MEASURED = [
    "Two H100s (stoker spanning 2 GPUs, --tp 2): this session's device time allowed one GPU only; the 2-GPU rows at "
    "the top level ran on 2× H200.",
    "nvfp4 ran once (stoker first): the second run's budget ran out before its pair; int4_awq's bare process in the "
    "second run was killed by the run's own budget during its export (rc -9 after 51.7 s), so that pair is not "
    "counted.",
    "Each time ratio is one stoker run against one bare run on the same GPU one after the other: the process that "
    "went first was the slower in 3 of the 4 complete pairs, by 7-14 %; more pairs were not affordable.",
    "NVFP4 inference (Hopper has no FP4 kernels), --hf-out, quantized KV cache, stoker's default calibration, real "
    "weights, 70B models: as at the top level.",
]


def _short(raw: dict) -> str:
    return f"{len(raw['gpus'])}× {raw['gpus'][0]['name']}"


def _label(raw: dict) -> str:
    gpu = raw["gpus"][0]
    return (f"{len(raw['gpus'])}× {gpu['name']} ({gpu['memory_total_mib']} MiB each), driver {gpu['driver']}; "
            + ", ".join(f"{k} {v}" for k, v in raw["versions"].items()) + f"; {raw['date']}")


def report(raw_paths: list[Path], out_path: Path, section: str | None = None) -> dict:
    """Raw records of one or more device runs (same machine kind) → the committed result. Without `section` they
    make the top level (sections already in out_path are kept); with it they make out_path's sections[section]
    and the rest of the file stays as it is."""
    sys.path.insert(0, str(ROOT))
    from stoker.gpu import memory, rules
    from stoker.gpu.facts import from_config

    raws = [json.loads(p.read_text()) for p in raw_paths]
    first = raws[0]
    facts = from_config({"architectures": ["LlamaForCausalLM"], **first["model"]["config"]})
    cal = first["calibration"]
    one_gpu = first.get("mode", "").startswith("one GPU")
    short = _short(first)

    def runs(raw: dict, tool: str) -> dict:
        return {(r["format"], r["gpus"]): r for r in raw["runs"] if r["tool"] == tool}

    rows = []
    for (fmt, gpus), r in runs(first, "stoker").items():
        per_run = [runs(raw, "stoker").get((fmt, gpus)) for raw in raws]  # None: not run that time (budget)
        measured = [r["peak_over_idle_mib"][str(g)] for g in r["gpu_indices"]]
        same = all([x["peak_over_idle_mib"][str(g)] for g in x["gpu_indices"]] == measured for x in per_run if x)
        peaks = memory.gpu_peaks(facts, fmt, gpus, cal["batch_size"], cal["seq_len"])
        estimate = [p.total >> 20 for p in peaks]
        busiest = memory.quantize_peak_bytes(facts, fmt, gpus, cal["batch_size"], cal["seq_len"]) >> 20
        row = {"device": short, "format": fmt, "gpus": gpus, "ok": all(x["rc"] == 0 for x in per_run if x),
               "runs_measured": sum(1 for x in per_run if x),
               "note": "export only: H100/H200 (sm_90) have no FP4 kernels" if fmt == "nvfp4" else None,
               "peak_mib_per_gpu_measured": measured, "same_peaks_in_every_run": same,
               "peak_mib_per_gpu_estimate": estimate,
               "estimate_over_measured_per_gpu": [round(e / m, 3) for e, m in zip(estimate, measured)],
               "busiest_measured_mib": max(measured), "busiest_estimate_mib": busiest,
               "estimate_over_measured": round(busiest / max(measured), 3),
               "estimate_terms_mib_per_gpu": [{k: getattr(p, k) >> 20 for k in
                                               ("weights", "state", "calibration", "export", "context")}
                                              for p in peaks],
               "torch_peak_reserved_mib": (r.get("result") or {}).get("peak_reserved_mib"),
               "devices": (r.get("result") or {}).get("devices"),
               "wall_s": [x["wall_s"] for x in per_run if x],
               "calibration_s": [(x.get("result") or {}).get("calibration_s") for x in per_run if x],
               "trtllm_export_s": [(x.get("result") or {}).get("trtllm_export_s") for x in per_run if x],
               "export_bytes": r["export_bytes"], "export_bytes_rules_weight_bytes": rules.weight_bytes(facts, fmt),
               "side_by_side_with": r["side_by_side_with"]}
        if gpus == 1:
            bare = [runs(raw, "bare").get((fmt, 1)) for raw in raws]
            # A run counts where both its stoker and its bare process finished (rc 0).
            pairs = [(x, b) for x, b in zip(per_run, bare) if x and b and x["rc"] == 0 and b["rc"] == 0]
            if pairs:
                b0 = pairs[0][1]
                bpeak = max(b0["peak_over_idle_mib"].values())
                row["bare_modelopt"] = {
                    "wall_s": [b["wall_s"] for _, b in pairs], "peak_mib": bpeak,
                    "calibration_s": [(b.get("result") or {}).get("calibration_s") for _, b in pairs],
                    "export_s": [(b.get("result") or {}).get("export_s") for _, b in pairs],
                    "torch_peak_reserved_mib": (b0.get("result") or {}).get("peak_reserved_mib"),
                    "export_bytes": b0["export_bytes"],
                    "stoker_over_bare_time": [round(x["wall_s"] / b["wall_s"], 3) for x, b in pairs],
                    "stoker_over_bare_memory": round(max(measured) / bpeak, 3)}
                if one_gpu:
                    row["bare_modelopt"]["first"] = ["stoker" if x["step"] < b["step"] else "bare" for x, b in pairs]
                    row["bare_modelopt"]["stoker_over_bare_time_summed"] = round(
                        sum(x["wall_s"] for x, _ in pairs) / sum(b["wall_s"] for _, b in pairs), 3)
                left_out = [{"run": k + 1, "rc": b["rc"], "timed_out": b["timed_out"], "wall_s": b["wall_s"],
                             "peak_mib": max(b["peak_over_idle_mib"].values())}
                            for k, b in enumerate(bare) if b and b["rc"] != 0]
                if left_out:
                    row["bare_modelopt"]["not_counted"] = left_out
        rows.append(row)
    what = ("stoker.gpu.quantize_worker on two GPUs: peak GPU memory per GPU (nvidia-smi memory.used sampled every "
            "200 ms, minus the idle reading) against stoker/gpu/memory.py, wall time (process start to exit), TRT-LLM "
            "checkpoint size; each one-GPU run side by side with ModelOpt alone (benchmarks/gpu_bare_modelopt.py, "
            "same calibration) on the other GPU")
    if one_gpu:
        what = ("stoker.gpu.quantize_worker on one GPU: peak GPU memory (nvidia-smi memory.used sampled every 200 ms, "
                "minus the idle reading) against stoker/gpu/memory.py, wall time (process start to exit), TRT-LLM "
                "checkpoint size; each run beside ModelOpt alone (benchmarks/gpu_bare_modelopt.py, same calibration) "
                "on the same GPU one after the other (rows' bare_modelopt.first says which went first)")
    log = f"benchmarks/results/gpu_quantize_{first['gpus'][0]['name'].split()[1].lower()}x{len(first['gpus'])}.log"
    script = ("bash benchmarks/gpu_quantize.sh on the device (→ benchmarks/gpu_quantize.py device), then "
              "python3 benchmarks/gpu_quantize.py report RAW.json [RAW.json …]; logs: " + log)
    if one_gpu:
        script = ("ONE_GPU=1 bash benchmarks/gpu_quantize.sh, then ONE_GPU=1 SWAP=1 (each pair the other way "
                  "round), on kind nvidia-h100-x1 (→ benchmarks/gpu_quantize.py device --one-gpu [--swap]), then "
                  f"python3 benchmarks/gpu_quantize.py report --section {section} RAW.json [RAW.json …]; logs: {log}")
    out = {"what": what,
           "device": _label(first), "device_runs": [_label(raw) for raw in raws],
           "script": script,
           "model": f"Llama-3-8B shapes (hidden 4096, 32 layers, intermediate 14336, 32/8 heads, vocab 128256, "
                    f"untied), random bf16 weights, {(first.get('make_model') or {}).get('result')}",
           "calibration": f"{cal['size']} windows × {cal['seq_len']} tokens, batch {cal['batch_size']}, "
                          "stoker/data/calibration.txt; kv cache none; --tp = GPUs",
           "context": [{k: raw["context"].get(k) for k in ("peak_over_idle_mib", "reserved_mib", "extensions_loaded")}
                       for raw in raws],
           "memory_model_constant_mib": memory.CUDA_CONTEXT_BYTES >> 20,
           "setup_s": [raw.get("setup_s") for raw in raws], "device_run_s": [raw.get("total_s") for raw in raws],
           "goals": {"estimate_over_measured": "within 10 % (0.90-1.10)", "stoker_over_bare": "≤ 1.05 (time, memory)"},
           "first_estimate": FIRST_ESTIMATE, "runs": rows,
           "skipped": [s for raw in raws for s in raw.get("skipped", [])], "not_measured": NOT_MEASURED}
    existing = json.loads(out_path.read_text()) if out_path.is_file() else {}
    if section is None:
        if existing.get("sections"):
            out["sections"] = existing["sections"]
        whole = out
    else:
        out["first_estimate"] = ("stoker/gpu/memory.py as for the top level's H200 runs, not changed for these: "
                                 "its estimates were written before any H100 run.")
        out["not_measured"] = H100_NOT_MEASURED if "H100" in short else []
        whole = existing
        whole.setdefault("sections", {})[section] = out
    out_path.write_text(json.dumps(whole, indent=1, ensure_ascii=False) + "\n")
    return out


def table(result: dict) -> str:
    lines = ["| device | format | GPUs | peak MiB per GPU, measured | estimate | estimate / measured (busiest) "
             "| wall s | TRT-LLM checkpoint | stoker / bare: time; memory |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        b = r.get("bare_modelopt")
        ratio = "—"
        if b:
            times = [f"{t:.2f}" for t in b["stoker_over_bare_time"]]
            if "first" in b:  # one GPU: which process of the pair ran first
                times = [f"{t} ({first} first)" for t, first in zip(times, b["first"])]
            ratio = f"{', '.join(times)}; {b['stoker_over_bare_memory']:.2f}"
        fmt = r["format"] + (" (export only)" if r["format"] == "nvfp4" else "")
        lines.append(f"| {r['device']} | {fmt} | {r['gpus']} | "
                     f"{' / '.join(f'{m:,}' for m in r['peak_mib_per_gpu_measured'])} | "
                     f"{' / '.join(f'{e:,}' for e in r['peak_mib_per_gpu_estimate'])} | "
                     f"{r['estimate_over_measured']:.2f} | {', '.join(f'{w:.0f}' for w in r['wall_s'])} | "
                     f"{r['export_bytes'] / 1e9:.2f} GB | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("device")
    d.add_argument("--out", type=Path, required=True)
    d.add_argument("--tokenizer", type=Path, required=True)
    d.add_argument("--budget-s", type=float, default=530)
    d.add_argument("--steps", help="comma-separated indices into plan(); default all")
    d.add_argument("--one-gpu", action="store_true", help="every process alone on GPU 0, one after the other")
    d.add_argument("--swap", action="store_true", help="--one-gpu: the other process of each pair first")
    m = sub.add_parser("make-model")
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--tokenizer", type=Path, required=True)
    sub.add_parser("context")
    r = sub.add_parser("report")
    r.add_argument("raw", type=Path, nargs="+")
    r.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_quantize.json")
    r.add_argument("--section", help="write the runs as sections[SECTION] of --out (e.g. h100_one_gpu), keeping the "
                   "rest of the file")
    a = p.parse_args()
    if a.cmd == "device":
        device(a.out, a.tokenizer, a.budget_s, {int(k) for k in a.steps.split(",")} if a.steps else None,
               a.one_gpu, a.swap)
    elif a.cmd == "make-model":
        make_model(a.out, a.tokenizer)
    elif a.cmd == "context":
        context()
    else:
        print(table(report(a.raw, a.out, a.section)))


if __name__ == "__main__":
    main()
