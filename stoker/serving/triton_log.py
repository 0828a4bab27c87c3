"""Which lines of a Triton server's output belong in the run's log.

Triton logs every step of its startup (glog `I` lines) and then its option and model tables, ~60
lines per backend; a run's log wants what went wrong, not that. The whole output stays in the
container's log (`docker logs <container>`); the run's log gets warnings, errors and anything that
is not Triton's own format (a model's Python traceback), except the lines every GPU build of Triton
prints on a machine without a GPU.
"""

from __future__ import annotations

import re

_GLOG = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ")

# Said by the CPU image (a GPU build of Triton, from the nvidia-pytriton wheel) on every start or first
# request where there is no GPU; nothing depends on them (FACTS: "Harmless on CPU").
CPU_HARMLESS = (
    "CudaDriverHelper has not been initialized",
    "unable to create stream for ensemble: CUDA driver version is insufficient",
    "Failed to initialize NVML",
    "DCGM unable to start",
    "Unable to allocate pinned system memory",
    "failed to allocate pinned system memory: no pinned memory pool",
)


# The python backend now and then aborts while its stubs start on a loaded host (upstream
# triton-inference-server/server#8882): the process dies with this line and exit code 134. The model repository is
# not at fault; the next start loads it. Seen in fresh-clone CI runs, from a host-started server and from a container.
IPC_ABORT = "boost::interprocess::lock_exception"


def ipc_abort(output: str) -> bool:
    """True when a server's output (one start's only) ends in the python backend's transient IPC abort."""
    return IPC_ABORT in output


# Seen once in the project's CI (a loaded 2-core host): a candidate loaded every model, printed its backend and model
# tables, and then for a whole minute neither logged its metrics nor opened a port, though its process still ran.
# Nothing in the repository can cause that (every model was READY), so the stalled server is replaced.
_HEADER_ONLY = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]\s*$")


def stalled_after_load(tail: str) -> bool:
    """True when a server's filtered log tail (tables dropped) ends in the table headers that follow a finished load:
    every model loaded, and no endpoint started since."""
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    loaded = [i for i, ln in enumerate(lines) if "successfully loaded" in ln]
    if not loaded:
        return False
    after = lines[loaded[-1] + 1:]
    return bool(after) and all(_HEADER_ONLY.match(ln) for ln in after)


def shown(line: str) -> bool:
    """True when a line of Triton's output is worth the user's attention in the run log."""
    text = line.strip()
    if not text or text[0] in "+|":  # the option, backend and model tables, and their borders
        return False
    glog = _GLOG.match(text)
    if glog and glog.group(1) == "I":
        return False
    return not any(h in text for h in CPU_HARMLESS)
