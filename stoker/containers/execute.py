"""Run one pipeline step inside a container image (Docker SDK), or in-process when already inside it.

A `ContainerStep` is data: image, argv, mounts, public env, the *names* of secret env
vars, GPUs, shm and ulimits. `stoker render` writes steps as JSON; the executors run them:

- `DockerExecutor`: GPU device requests, bind mounts, shm/ulimits; logs streamed line by
  line to a callback with secret values scrubbed; the exit status checked; the container
  removed on success, failure, timeout, cancellation and KeyboardInterrupt.
- `LocalExecutor`: the same step as a child process on this machine, for a worker that
  already runs inside the step's image (a Prefect worker on a GPU node); container paths
  map back to the mounts' host paths.

Secret values are handed to `run(..., secrets=...)` only: never stored in a step, never
logged, never rendered.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from ..errors import StepError, StokerError

Log = Callable[[str], None]
LABEL = "ai.stoker.step"
INSIDE_IMAGE_ENV = "STOKER_INSIDE_IMAGE"  # set in the worker's own image: steps for that image run in-process


class ContainerStepFailed(StepError):
    """The step's process exited non-zero."""


class ContainerStepTimeout(StepError):
    """The step ran past its time limit and was killed."""


class ContainerStepCancelled(StepError):
    """The step was cancelled and its container removed."""


class ExecutorUnavailable(StokerError):
    """Docker cannot be reached, or the image is missing."""


@dataclass(frozen=True)
class Mount:
    host: str
    container: str
    read_only: bool = True


@dataclass(frozen=True)
class ContainerStep:
    name: str
    image: str
    argv: list[str]
    mounts: list[Mount] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    secret_env: list[str] = field(default_factory=list)  # names only
    workdir: str | None = None
    gpus: list[int] | None = None  # device ids; None: no GPU
    shm_size: str | None = None
    ulimits: dict[str, tuple[int, int]] = field(default_factory=dict)
    entrypoint: list[str] | None = None  # None: the image's own
    timeout_s: float = 3600.0

    def to_json(self) -> dict:
        d = asdict(self)
        d["ulimits"] = {k: {"soft": s, "hard": h} for k, (s, h) in self.ulimits.items()}
        return d


@dataclass(frozen=True)
class ExecResult:
    name: str
    exit_code: int
    duration_s: float
    log_tail: list[str]
    where: str  # "docker:<container name>" or "local"


def _scrubber(secrets: dict[str, str]) -> Callable[[str], str]:
    values = sorted((v for v in secrets.values() if v), key=len, reverse=True)

    def scrub(line: str) -> str:
        for v in values:
            line = line.replace(v, "***")
        return line

    return scrub


def _missing_secrets(step: ContainerStep, secrets: dict[str, str]) -> None:
    missing = [n for n in step.secret_env if not secrets.get(n)]
    if missing:
        # A missing secret is an error, never an empty string.
        raise StepError(f"{step.name}: secret env {', '.join(missing)} not provided")


class DockerExecutor:
    """Runs steps in containers on a Docker daemon."""

    def __init__(self, client=None, labels: dict[str, str] | None = None, poll_s: float = 0.5) -> None:
        import docker

        try:
            self.client = client or docker.from_env()
            self.client.ping()
        except Exception as err:  # noqa: BLE001 - any failure here means: no daemon
            raise ExecutorUnavailable(f"Docker not reachable: {str(err).splitlines()[0][:120]}") from None
        self.labels = labels or {}
        self.poll_s = poll_s

    def create_kwargs(self, step: ContainerStep, secrets: dict[str, str]) -> dict:
        """Docker SDK `containers.create` arguments for a step (pure apart from the SDK's types)."""
        from docker.types import DeviceRequest, Ulimit
        from docker.types import Mount as DockerMount

        kw: dict = {
            "image": step.image, "command": list(step.argv), "detach": True,
            "environment": {**step.env, **{n: secrets[n] for n in step.secret_env}},
            "mounts": [DockerMount(target=m.container, source=m.host, type="bind", read_only=m.read_only)
                       for m in step.mounts],
            "labels": {LABEL: step.name, **self.labels},
            "ulimits": [Ulimit(name=k, soft=s, hard=h) for k, (s, h) in step.ulimits.items()],
        }
        if step.entrypoint is not None:
            kw["entrypoint"] = list(step.entrypoint)
        if step.workdir:
            kw["working_dir"] = step.workdir
        if step.shm_size:
            kw["shm_size"] = step.shm_size
        if step.gpus is not None:
            # One request naming exact devices: the step sees only those GPUs, as ranks 0..n-1.
            kw["device_requests"] = [DeviceRequest(device_ids=[str(i) for i in step.gpus], capabilities=[["gpu"]])]
        return kw

    def run(self, step: ContainerStep, log: Log, secrets: dict[str, str] | None = None,
            cancel: threading.Event | None = None) -> ExecResult:
        """Run to completion; raises ContainerStepFailed/Timeout/Cancelled. The container never outlives this."""
        import docker

        secrets = secrets or {}
        _missing_secrets(step, secrets)
        scrub = _scrubber(secrets)
        for m in step.mounts:  # a bind mount of a missing host folder fails; outputs may not exist yet
            if not m.read_only:
                os.makedirs(m.host, exist_ok=True)
        try:
            container = self.client.containers.create(**self.create_kwargs(step, secrets))
        except docker.errors.ImageNotFound:
            raise ExecutorUnavailable(f"{step.name}: image {step.image} not found; pull or build it first") from None
        except docker.errors.APIError as err:
            raise StepError(f"{step.name}: container not created: {scrub(str(err.explanation or err))[:200]}") from None
        tail: deque[str] = deque(maxlen=50)
        t0 = time.perf_counter()
        pump = threading.Thread(target=self._pump, args=(container, log, tail, scrub), daemon=True)
        try:
            container.start()
            pump.start()
            code = self._wait(container, step, t0, cancel)
            pump.join(timeout=10)
        finally:
            # Success, failure, timeout, cancel or KeyboardInterrupt: the container goes.
            try:
                container.remove(force=True)
            except docker.errors.NotFound:
                pass
        result = ExecResult(step.name, code, time.perf_counter() - t0, list(tail), f"docker:{container.name}")
        if code != 0:
            last = next((line for line in reversed(tail) if line.strip()), "no output")
            raise ContainerStepFailed(f"{step.name} failed in {step.image} (exit {code}): {last[:300]}")
        return result

    def _wait(self, container, step: ContainerStep, t0: float, cancel: threading.Event | None) -> int:
        import requests

        while True:
            if cancel is not None and cancel.is_set():
                container.kill()
                raise ContainerStepCancelled(f"{step.name} cancelled; container removed")
            if time.perf_counter() - t0 > step.timeout_s:
                container.kill()
                raise ContainerStepTimeout(f"{step.name} ran past {step.timeout_s:.0f}s; container killed")
            try:
                status = container.wait(timeout=self.poll_s)
            except (requests.exceptions.ReadTimeout, requests.exceptions.ConnectionError):
                continue
            return int(status.get("StatusCode", -1))

    @staticmethod
    def _pump(container, log: Log, tail: deque[str], scrub: Callable[[str], str]) -> None:
        buf = b""
        try:
            for chunk in container.logs(stream=True, follow=True, stdout=True, stderr=True):
                buf += chunk
                while b"\n" in buf:
                    raw, buf = buf.split(b"\n", 1)
                    _emit(raw, log, tail, scrub)
        except Exception as err:  # noqa: BLE001 - the container went away mid-stream: its status says why
            tail.append(f"(log stream ended: {type(err).__name__})")
        if buf:
            _emit(buf, log, tail, scrub)


def _emit(raw: bytes, log: Log, tail: deque[str], scrub: Callable[[str], str]) -> None:
    line = scrub(raw.decode("utf-8", "replace").rstrip("\r"))
    if line.strip():
        tail.append(line)
        log(line)


class LocalExecutor:
    """Runs a step as a child process here: the worker already is inside the step's image."""

    def run(self, step: ContainerStep, log: Log, secrets: dict[str, str] | None = None,
            cancel: threading.Event | None = None) -> ExecResult:
        secrets = secrets or {}
        _missing_secrets(step, secrets)
        scrub = _scrubber(secrets)
        to_host = host_path_mapper(step.mounts)
        env = {**os.environ, **{k: to_host(v) for k, v in step.env.items()},
               **{n: secrets[n] for n in step.secret_env}}
        if step.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in step.gpus)
        argv = [*(step.entrypoint or []), *(to_host(a) for a in step.argv)]
        tail: deque[str] = deque(maxlen=50)
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                cwd=to_host(step.workdir) if step.workdir else None, start_new_session=True)
        pump = threading.Thread(target=self._pump, args=(proc, log, tail, scrub), daemon=True)
        pump.start()
        try:
            while True:
                try:
                    code = proc.wait(timeout=0.2)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if cancel is not None and cancel.is_set():
                    raise ContainerStepCancelled(f"{step.name} cancelled; process killed")
                if time.perf_counter() - t0 > step.timeout_s:
                    raise ContainerStepTimeout(f"{step.name} ran past {step.timeout_s:.0f}s; process killed")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: children go too
                proc.wait()
            pump.join(timeout=5)
        if code != 0:
            last = next((line for line in reversed(tail) if line.strip()), "no output")
            raise ContainerStepFailed(f"{step.name} failed in-process (exit {code}): {last[:300]}")
        return ExecResult(step.name, code, time.perf_counter() - t0, list(tail), "local")

    @staticmethod
    def _pump(proc: subprocess.Popen, log: Log, tail: deque[str], scrub: Callable[[str], str]) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            _emit(raw.rstrip(b"\n"), log, tail, scrub)


def host_path_mapper(mounts: list[Mount]) -> Callable[[str], str]:
    """Rewrite container paths (and `--flag=/container/path`) to the mounts' host paths."""
    pairs = sorted(((m.container.rstrip("/"), m.host.rstrip("/")) for m in mounts), key=lambda p: -len(p[0]))

    def to_host(value: str) -> str:
        prefix, sep, path = value.rpartition("=") if value.startswith("--") else ("", "", value)
        for c, h in pairs:
            if path == c or path.startswith(c + "/"):
                return f"{prefix}{sep}{h}{path[len(c):]}"
        return value

    return to_host


def choose_executor(step: ContainerStep, mode: str = "auto", client=None):
    """'docker', 'local', or 'auto': local when this process runs inside the step's image."""
    if mode == "local" or (mode == "auto" and os.environ.get(INSIDE_IMAGE_ENV) == step.image.split("@")[0]):
        return LocalExecutor()
    return DockerExecutor(client)
