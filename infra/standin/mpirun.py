#!/usr/bin/env python3
"""STAND-IN, NOT Open MPI: the `mpirun` of stoker's stand-in serving image (installed as /usr/local/bin/mpirun).

A GPU backend with tensor × pipeline parallelism > 1 is started by stoker as
``mpirun --allow-run-as-root -n 1 tritonserver ... : -n 1 tritonserver ...`` (stoker/gpu/trtllm.py serve_command),
one rank per GPU. The CPU Triton image has no MPI; this script does, on one host, what Open MPI's mpirun(1) is
documented to do for exactly that command line, so the stand-in runs the product's own command and its ranks are
separate processes, as on a GPU host. It starts processes; it offers no MPI communication (the stand-in's ranks
need none: rank 0 computes the whole model, the others wait in a worker loop, infra/standin/rank_model.py).

Open MPI behaviours modelled, each cited where it is implemented. [man] is the mpirun(1) man page of Open MPI 4.1
(https://www.open-mpi.org/doc/v4.1/man1/mpirun.1.php; the v5.0 page, docs.open-mpi.org/en/v5.0.x/man-openmpi/
man1/mpirun.1.html, says the same for these); [env] is "Environment variables set for MPI applications"
(https://docs.open-mpi.org/en/v5.0.x/tuning-apps/environment-var.html). Any other option is refused with one line:
running a command line this script would only half honour would prove nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

PROG = "mpirun (stoker stand-in)"
# [man] "Signal Propagation": on SIGTERM or SIGINT mpirun sends every process of the job SIGTERM, waits "a small
# number of seconds", then sends SIGKILL. The number is ours; tritonserver needs a moment to unload its models.
KILL_AFTER_S = 10.0
NP_OPTIONS = ("-n", "-np", "--n", "--np")
MODELLED = "--allow-run-as-root, and per app context -n/-np N"


class UsageError(ValueError):
    """A command line this stand-in does not model or that Open MPI would reject: one line, exit 1."""


@dataclass(frozen=True)
class AppContext:
    copies: int
    argv: tuple[str, ...]


@dataclass(frozen=True)
class Job:
    allow_run_as_root: bool
    contexts: tuple[AppContext, ...]

    @property
    def size(self) -> int:
        return sum(c.copies for c in self.contexts)

    def ranks(self) -> list[tuple[int, tuple[str, ...]]]:
        """(rank, argv) per process. [man] MIMD: the app contexts are separated by ':' and ranks are numbered
        across them in the order given (the first context's processes take the lowest ranks)."""
        argvs = [context.argv for context in self.contexts for _ in range(context.copies)]
        return list(enumerate(argvs))


def parse(argv: list[str]) -> Job:
    """[man] SYNOPSIS, MIMD model: ``mpirun [global_options] [local_options1] <program1> [<args1>] : ...``.
    Global options come before the first context; each context's local options come before its program, and
    everything after the program up to the next lone ':' is the program's."""
    allow_root = False
    groups: list[list[str]] = [[]]
    for arg in argv:
        if arg == ":":
            groups.append([])
        else:
            groups[-1].append(arg)
    contexts = []
    for number, words in enumerate(groups, 1):
        copies: int | None = None
        i = 0
        while i < len(words) and words[i].startswith("-"):
            option = words[i]
            if option in ("--allow-run-as-root", "-allow-run-as-root"):  # global; Open MPI takes it anywhere here
                allow_root = True
                i += 1
                continue
            if option not in NP_OPTIONS:
                raise UsageError(f"option {option!r} is not modelled (only {MODELLED})")
            if i + 1 >= len(words) or not words[i + 1].isdigit() or int(words[i + 1]) < 1:
                raise UsageError(f"app context {number}: {option} needs a positive number of processes")
            if copies is not None:
                raise UsageError(f"app context {number}: the number of processes is given twice")
            copies = int(words[i + 1])
            i += 2
        if i >= len(words):
            raise UsageError(f"app context {number} names no program" + (" (a ':' at the end?)" if number > 1 else ""))
        if copies is None:
            # [man] without -n, Open MPI starts one process per slot of the allocation; slots are not modelled.
            raise UsageError(f"app context {number}: give -n N (one process per slot is not modelled)")
        contexts.append(AppContext(copies, tuple(words[i:])))
    return Job(allow_run_as_root=allow_root, contexts=tuple(contexts))


def rank_env(base: dict[str, str], rank: int, size: int) -> dict[str, str]:
    """[env] OMPI_COMM_WORLD_SIZE / _RANK / _LOCAL_SIZE / _LOCAL_RANK on every process; one host here, so the
    local rank is the rank (the stand-in's ranks all share the container)."""
    return {**base, "OMPI_COMM_WORLD_SIZE": str(size), "OMPI_COMM_WORLD_RANK": str(rank),
            "OMPI_COMM_WORLD_LOCAL_SIZE": str(size), "OMPI_COMM_WORLD_LOCAL_RANK": str(rank)}


class Runner:
    def __init__(self, job: Job):
        self.job = job
        self.procs: dict[int, tuple[int, subprocess.Popen]] = {}  # pid -> (rank, process)
        self.stopping_since: float | None = None
        self.exit_code = 0

    def start(self) -> None:
        for rank, argv in self.job.ranks():
            try:
                proc = subprocess.Popen(list(argv), env=rank_env(dict(os.environ), rank, self.job.size))
            except OSError as err:
                # [man] an executable that cannot be found or run: mpirun reports it and the job does not run.
                self.terminate(f"rank {rank}: cannot start {argv[0]!r} ({err.strerror})", 1)
                self.reap_all()
                return
            self.procs[proc.pid] = (rank, proc)

    def terminate(self, why: str, code: int) -> None:
        """Send SIGTERM to every rank still running (once), remembering the first failure's code."""
        if self.stopping_since is None:
            print(f"{PROG}: {why}; terminating the job", file=sys.stderr, flush=True)
            self.stopping_since = time.monotonic()
            self.exit_code = code
            for _rank, proc in self.procs.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)

    def on_signal(self, signum: int, _frame) -> None:
        # [man] "Signal Propagation": SIGTERM/SIGINT to mpirun kill the whole job (SIGTERM to each process).
        self.terminate(f"received {signal.Signals(signum).name}", 128 + signum)

    def reap_all(self) -> None:
        while any(p.poll() is None for _r, p in self.procs.values()):
            if self.stopping_since is not None and time.monotonic() - self.stopping_since > KILL_AFTER_S:
                for _rank, proc in self.procs.values():
                    if proc.poll() is None:
                        proc.kill()  # [man] "Signal Propagation": SIGKILL after the wait
            time.sleep(0.2)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        self.start()
        while any(p.returncode is None for _r, p in self.procs.values()):
            if self.stopping_since is not None and time.monotonic() - self.stopping_since > KILL_AFTER_S:
                self.reap_all()
                break
            for rank, proc in list(self.procs.values()):
                if proc.returncode is None and proc.poll() is not None and proc.returncode != 0:
                    code = status_code_of(proc.returncode)
                    # [man] "Process Termination / Signal Handling": a process that dies abnormally (non-zero
                    # exit or a signal) makes mpirun report it and kill the rest of the application; [man]
                    # "Exit status": mpirun then exits non-zero, with the status of the process that failed.
                    self.terminate(f"rank {rank} (pid {proc.pid}) exited with status {code}", code)
            time.sleep(0.2)
        return self.exit_code


def status_code_of(returncode: int) -> int:
    """Popen's returncode (negative: killed by that signal) as a shell's status."""
    return 128 - returncode if returncode < 0 else returncode


def main(argv: list[str]) -> int:
    try:
        job = parse(argv)
    except UsageError as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 1
    if os.geteuid() == 0 and not job.allow_run_as_root:
        # [man] --allow-run-as-root: without it (or its environment variables, not modelled) mpirun refuses root.
        print(f"{PROG}: running as root needs --allow-run-as-root", file=sys.stderr)
        return 1
    return Runner(job).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
