"""Where the suite's CPU goes: runs a command (normally `.ci/run` on a fresh clone) and attributes the machine's CPU
time while it runs to the kinds of process that used it; writes JSON.

    CI=true python3 benchmarks/suite_cpu.py --out benchmarks/results/suite_cpu.json -- bash .ci/run > ci.log 2>&1

Why: the service tier keeps both cores busy, so it gets shorter only by doing less work, and the question is which
work. Two measurements side by side, both from /proc:
- **busy CPU-seconds of the whole machine** (/proc/stat, exact): every process, kernel time included, from the
  command's start to its end;
- **per process** (each /proc/PID/stat read every --interval s, standard library only, no root tool): its user +
  system time, less what it had used before the command started, grouped by what its command line says it is
  (KINDS). Sampling misses a process that lives less than one interval and the last interval of each one that
  exits, so the attributed sum is below the machine's; the JSON gives both and the difference.
The sampler's own CPU is reported as a kind of its own. Stdlib only: the clone has no virtualenv before set-up.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")

# (kind, pattern on the command line), first match wins; most specific first.
KINDS = [
    ("tritonserver", r"bin/tritonserver "),
    ("quantize worker (modelopt)", r"-m stoker\.(workers|gpu)\.quantize"),
    ("evaluation baseline worker", r"-m stoker\.workers\.evaluate_baseline"),
    ("reference build worker", r"-m stoker\.workers\.build_reference"),
    ("tiny model / adapter generation", r"-m stoker\.workers\.tiny"),
    ("other stoker workers", r"-m stoker\.workers\."),
    ("stoker OpenAI service", r"-m stoker(_openai|\.openai_api)"),
    ("stoker CLI: run", r"(-m stoker\.cli|bin/stoker) run\b"),
    ("stoker CLI: other commands", r"(-m stoker\.cli|bin/stoker)\b"),
    ("Prefect server (prefect server start)", r"prefect server start"),
    ("Prefect temporary API (uvicorn)", r"uvicorn .*prefect\.server"),
    ("Prefect flow-run subprocess", r"prefect\.runner\._workspace_supervisor|prefect\.engine"),
    ("Prefect worker", r"prefect worker start"),
    ("Prefect CLI: other", r"bin/prefect\b"),
    ("moto_server (S3)", r"moto_server"),
    ("olah (Hub mirror)", r"olah"),
    ("pytest processes (xdist workers, python -c helpers)", r"pytest|execnet|exec\(eval\(|python3?(\.\d+)? -c "),
    ("pip / compileall (set-up)", r"-m pip |-m compileall"),
    ("image builds (debootstrap, apt, docker build)", r"debootstrap|apt-get|dpkg|docker build|buildkit"),
    ("dockerd, containerd, shims", r"dockerd|containerd|runc"),
    ("haproxy", r"haproxy"),
    ("postgres", r"postgres"),
    ("chromium (UI test)", r"chrom"),
    ("git", r"^git "),
]
_COMPILED = [(kind, re.compile(p)) for kind, p in KINDS]
KERNEL = "kernel threads (no command line)"
SAMPLER = "this sampler"
OTHER = "other"


def _stub_kind(cmdline: str) -> str:
    """A Python backend stub by the model it runs: its next-to-last argument is the instance (MODEL_GROUP_INDEX)."""
    parts = cmdline.split()
    model = re.sub(r"_\d+_\d+$", "", parts[-2]) if len(parts) > 2 else "?"
    group = ("the model (tensorrt_llm)" if model.startswith("tensorrt_llm")
             else "pre/postprocessing" if model in ("preprocessing", "postprocessing") else "other models")
    return f"triton python stub: {group}"


def kind_of(cmdline: str) -> str:
    if not cmdline:
        return KERNEL
    if "triton_python_backend_stub" in cmdline:
        return _stub_kind(cmdline)
    return next((kind for kind, rx in _COMPILED if rx.search(cmdline)), OTHER)


def machine_busy() -> tuple[float, float]:
    """(busy, idle) CPU-seconds of all cores since boot, from /proc/stat's first line."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / TICK, (idle + iowait) / TICK


def snapshot(names: dict[tuple[str, str], str]) -> dict[tuple[str, str], float]:
    """{(pid, start time): CPU-seconds so far} of every process now; ``names`` gets the command line of each process
    not in it yet (read once: a process keeps its command line, and the sampler's own CPU counts against the run)."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            key = (pid, rest[19])
            if key not in names:
                names[key] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
                    errors="replace").strip()
        except OSError:  # gone between listing and reading
            continue
        out[key] = (int(rest[11]) + int(rest[12])) / TICK
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("suite_cpu.py: give the command after --, e.g. -- bash .ci/run", file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--interval", type=float, default=0.5)
    args = parser.parse_args(argv[:split])
    command = argv[split + 1:]
    if not command:
        parser.error("no command after --")

    names: dict[tuple[str, str], str] = {}
    before = snapshot(names)  # what every process already alive had used: not the command's
    busy0, idle0 = machine_busy()
    t0 = time.monotonic()
    child = subprocess.Popen(command)
    peak: dict[tuple[str, str], float] = {}
    me = str(os.getpid())
    while True:
        for key, cpu in snapshot(names).items():
            peak[key] = max(peak.get(key, 0.0), cpu - before.get(key, 0.0))
        if child.poll() is not None:
            break
        time.sleep(args.interval)
    wall = time.monotonic() - t0
    busy1, idle1 = machine_busy()

    kinds: dict[str, dict] = {}
    for key, cpu in peak.items():
        if cpu <= 0:
            continue
        k = kinds.setdefault(SAMPLER if key[0] == me else kind_of(names[key]), {"cpu_s": 0.0, "processes": 0})
        k["cpu_s"] += cpu
        k["processes"] += 1
    attributed = sum(k["cpu_s"] for k in kinds.values())
    busy = busy1 - busy0
    rows = [{"kind": name, "cpu_s": round(k["cpu_s"], 1), "processes": k["processes"],
             "mean_cpu_s": round(k["cpu_s"] / k["processes"], 2),
             "share_of_attributed": round(k["cpu_s"] / attributed, 3)}
            for name, k in sorted(kinds.items(), key=lambda kv: -kv[1]["cpu_s"])]
    result = {
        "what": "CPU time by kind of process while the command ran (benchmarks/suite_cpu.py)",
        "command": " ".join(command),
        "cwd": os.getcwd(),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip(),
        "rc": child.returncode,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "wall_s": round(wall, 1),
        "machine_busy_cpu_s": round(busy, 1),
        "machine_idle_cpu_s": round(idle1 - idle0, 1),
        "machine_busy_share": round(busy / max(busy + idle1 - idle0, 1e-9), 3),
        "attributed_cpu_s": round(attributed, 1),
        "unattributed_cpu_s": round(busy - attributed, 1),
        "sample_interval_s": args.interval,
        "kinds": rows,
    }
    tmp = args.out.with_name(f".{args.out.name}.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, args.out)
    print(f"suite_cpu: {wall:.0f} s wall, {busy:.0f} busy CPU-s ({result['machine_busy_share']:.0%} of "
          f"{os.cpu_count()} cores), {attributed:.0f} attributed -> {args.out}", file=sys.stderr)
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
