"""Make sure a Docker daemon answers; start (and later stop) one only if we must.

Starting is done by infra/dockerd.sh (one implementation for CLI and library);
this module pings through the ``docker`` SDK and remembers, in a pid file under
``state_dir``, whether the running daemon is ours, so ``stop_daemon`` never
stops a daemon somebody else started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from stoker.containers.engine import DockerUnavailable, connect

DOCKERD_SH = Path(__file__).resolve().parents[2] / "infra" / "dockerd.sh"
PID_FILE = "dockerd.pid"
LOG_FILE = "dockerd.log"
# apt-get install docker.io may run first; the script's own wait is 60 s.
START_TIMEOUT_S = 600


def ensure_daemon(docker_host: str | None, state_dir: Path, start: bool = True) -> bool:
    """Return True if this call started a daemon, False if one already answered.

    Raises DockerUnavailable when none answers and ``start`` is False, when
    ``docker_host`` is not a local unix socket, or when starting failed.
    """
    try:
        connect(docker_host, timeout_s=10)
        return False
    except DockerUnavailable as err:
        if not start:
            raise
        cause = str(err)
    if docker_host and not docker_host.startswith("unix://"):
        raise DockerUnavailable(
            f"{cause}; a remote daemon ({docker_host}) is not started by stoker"
        )

    state_dir.mkdir(parents=True, exist_ok=True)
    pid_file = state_dir / PID_FILE
    pid_file.unlink(missing_ok=True)
    env = dict(
        os.environ, DOCKERD_PIDFILE=str(pid_file), DOCKERD_LOG=str(state_dir / LOG_FILE)
    )
    if docker_host:
        env["DOCKER_HOST"] = docker_host
    try:
        proc = subprocess.run(
            [str(DOCKERD_SH)],
            env=env,
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise DockerUnavailable(
            f"{DOCKERD_SH} did not finish within {START_TIMEOUT_S} s"
        ) from None
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        raise DockerUnavailable(
            lines[-1] if lines else f"{DOCKERD_SH} exited {proc.returncode}"
        )
    connect(docker_host, timeout_s=10)  # the SDK must agree with the script
    # No pid file: another process started the daemon between our ping and the script's.
    return pid_file.exists()


def stop_daemon(state_dir: Path, timeout_s: float = 30.0) -> bool:
    """Stop the daemon recorded in ``state_dir`` (only one we started); True if one was stopped."""
    pid_file = state_dir / PID_FILE
    try:
        pid = int(pid_file.read_text().strip())
    except (FileNotFoundError, ValueError):
        return False
    if not _is_dockerd(pid):  # gone already, or the pid was reused by another program
        pid_file.unlink(missing_ok=True)
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _is_dockerd(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _is_dockerd(pid):
        os.kill(pid, signal.SIGKILL)
    pid_file.unlink(missing_ok=True)
    return True


def _is_dockerd(pid: int) -> bool:
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return comm == "dockerd" and state != "Z"
