"""Run the real tritonserver from the nvidia-pytriton wheel on this host (no container).

The wheel ships tritonserver, the python backend and one backend stub per Python version, but
not laid out the way tritonserver wants: the stub must sit inside the backend directory, the
wheel's bundled libraries must be on LD_LIBRARY_PATH, and the stub embeds libpython, which must
match the interpreter whose site-packages (torch, tokenizers, ...) the models import. We build a
private backend directory per server, point the stub at this interpreter's libpython and
environment, and wait for /v2/health/ready.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from stoker.errors import StokerError
from stoker.serving import triton_log

LOG_TAIL_CHARS = 4000
_ERROR_LINE = re.compile(r"^(E\d{4} |error: )")
# Logged on every CPU-only start; not a cause of anything.
_HARMLESS_ON_CPU = ("CudaDriverHelper", "unable to create stream for ensemble", "NVML", "DCGM")


class TritonStartError(StokerError):
    """tritonserver could not be found, died while starting, or was not ready in time."""


@dataclass(frozen=True)
class TritonPorts:
    """The three listening ports of one tritonserver."""

    http: int
    grpc: int
    metrics: int


def pick_free_ports(host: str = "127.0.0.1") -> TritonPorts:
    """Three distinct ports free right now, outside the ephemeral range (see services.free_port)."""
    from .services import free_port

    http = free_port(host)
    grpc = free_port(host, exclude=(http,))
    metrics = free_port(host, exclude=(http, grpc))
    return TritonPorts(http=http, grpc=grpc, metrics=metrics)


def _pytriton_root() -> Path:
    try:
        import pytriton  # the wheel's Python side; only its files are used
    except ImportError:
        raise TritonStartError("nvidia-pytriton is not installed (pip install nvidia-pytriton==0.7.0)") from None
    return Path(pytriton.__file__).resolve().parent / "tritonserver"


def _libs_dir() -> Path:
    # auditwheel puts the wheel's shared libraries beside the package: site-packages/nvidia_pytriton.libs
    return _pytriton_root().parent.parent / "nvidia_pytriton.libs"


def _make_backend_dir(target: Path) -> Path:
    root = _pytriton_root()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise TritonStartError(f"nvidia-pytriton has no python backend stub for Python {version}")
    shutil.copytree(root / "backends", target, dirs_exist_ok=True)
    shutil.copy2(stub, target / "python" / "triton_python_backend_stub")
    return target


def _server_env(extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    # libpython of this very interpreter first: the system's libpython3.11 may be another patch
    # release than the stdlib and compiled packages the models import.
    ld_paths = [str(_libs_dir()), libdir, env.get("LD_LIBRARY_PATH", "")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in ld_paths if p)
    # The stub embeds Python in isolated mode: PYTHONPATH and PYTHONHOME are ignored (measured).
    # It locates its prefix by finding `python3` on PATH, and reads a pyvenv.cfg there, so this
    # interpreter's bin directory first on PATH gives the models this (virtual) environment.
    env["PATH"] = os.pathsep.join(p for p in (str(Path(sys.executable).parent), env.get("PATH", "")) if p)
    env.update(extra or {})
    return env


@dataclass
class LocalTriton:
    """A running tritonserver process started by `start`."""

    process: subprocess.Popen
    ports: TritonPorts
    log_path: Path
    work_dir: Path
    host: str = "127.0.0.1"
    exit_code: int | None = field(default=None)

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.ports.grpc}"

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def errors(self, limit: int = 10) -> str:
        """Triton's error-level log lines (model load failures and the like), the last `limit` of them."""
        lines = [line[:600] for line in self.log_tail(chars=1 << 20).splitlines()
                 if _ERROR_LINE.match(line) and not any(h in line for h in _HARMLESS_ON_CPU)]
        return "\n".join(lines[-limit:])

    def stop(self, deadline_s: float = 30.0) -> int:
        """SIGTERM the server, wait up to `deadline_s`, then SIGKILL its process group; return its exit code.

        Escalation matters: a single SIGTERM has been seen to hang tritonserver for ~10 minutes.
        """
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=deadline_s)
            except subprocess.TimeoutExpired:
                # Still ours and not reaped, so its pid is still its group id: the group holds the
                # server and its python backend stubs (started in its own session).
                os.killpg(self.process.pid, signal.SIGKILL)
        self.exit_code = self.process.wait()
        shutil.rmtree(self.work_dir, ignore_errors=True)
        return self.exit_code

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def start(
    repo_dir: Path | str,
    ports: TritonPorts,
    log_path: Path | str,
    *,
    ready_timeout_s: float = 180.0,
    extra_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    auto_complete: bool = False,
) -> LocalTriton:
    """Start tritonserver on `repo_dir` and return once every model is loaded and ready.

    Raises TritonStartError (with the log's tail) when the server exits while starting or is
    not ready within `ready_timeout_s`; the process is stopped before raising. A port another
    process took between its choice and Triton's bind (free_port's remaining race: another
    server, or a container's published port, chosen by another process) is not a failure of
    the repository: the server is started again on fresh ports (pick_free_ports), twice at most;
    the returned server's `ports` say which it got. So is the python backend's IPC abort while its stubs start
    (`_ipc_abort`): started again, twice at most.

    ``auto_complete``: let models complete their own config (the LLM API's model takes max_batch_size and
    decoupled from model.yaml that way); off otherwise, since stoker's ensemble configs are complete and each
    auto-completed model costs one more python stub start.
    """
    if not auto_complete:
        extra_args = ("--disable-auto-complete-config", *extra_args)
    for attempt in range(3):
        written = Path(log_path).stat().st_size if Path(log_path).is_file() else 0
        try:
            return _start_once(repo_dir, ports, log_path, ready_timeout_s, extra_args, env)
        except TritonStartError as err:
            if attempt < 2 and _ipc_abort(Path(log_path), written):
                continue
            if "already in use" not in str(err) or attempt == 2:
                raise
            ports = pick_free_ports()
    raise AssertionError("unreachable")


def _ipc_abort(log_path: Path, offset: int) -> bool:
    """Whether this attempt's log (from ``offset``) shows the python backend's transient IPC abort
    (stoker.serving.triton_log.IPC_ABORT); the log keeps every attempt."""
    with open(log_path, "rb") as log:
        log.seek(offset)
        return triton_log.ipc_abort(log.read().decode("utf-8", "replace"))


def _start_once(repo_dir: Path | str, ports: TritonPorts, log_path: Path | str, ready_timeout_s: float,
                extra_args: tuple[str, ...], env: dict[str, str] | None) -> LocalTriton:
    root = _pytriton_root()
    binary = root / "bin" / "tritonserver"
    if not binary.is_file():
        raise TritonStartError(f"tritonserver binary missing at {binary}")
    work_dir = Path(tempfile.mkdtemp(prefix="stoker-triton-"))
    backends = _make_backend_dir(work_dir / "backends")
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = [
        str(binary),
        f"--model-repository={repo_dir}",
        f"--backend-directory={backends}",
        f"--http-port={ports.http}",
        f"--grpc-port={ports.grpc}",
        f"--metrics-port={ports.metrics}",
        "--allow-gpu-metrics=false",
        "--exit-on-error=true",
        "--strict-readiness=true",
        # Triton waits this long at SIGTERM for requests still in flight (its default, 30 s, was every test
        # module's teardown whose client left a decoupled stream unfinished); a host-started server serves tests
        # and benchmarks, which have nothing left to wait for by then.
        "--exit-timeout-secs=3",
        *extra_args,
    ]
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=_server_env(env), start_new_session=True
        )
    server = LocalTriton(process=process, ports=ports, log_path=log_path, work_dir=work_dir)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            code = server.stop()
            raise TritonStartError(f"tritonserver exited with {code} while starting ({log_path}):\n{server.errors()}")
        if _ready(server.http_url):
            # Triton answers ready once HTTP is up and its models loaded, then starts its metrics service: a taken
            # metrics port makes it exit a few milliseconds after answering ready (seen in a fresh-clone CI).
            time.sleep(0.5)
            if process.poll() is None and "failed to start" not in server.log_tail():
                return server
            continue
        time.sleep(0.25)
    server.stop()
    raise TritonStartError(f"tritonserver not ready after {ready_timeout_s:.0f}s ({log_path}):\n{server.errors()}")
