"""A self-hosted Prefect stack on loopback: PostgreSQL (or SQLite), the API server with basic auth, process workers.

Used by ``infra/prefect/stack.sh`` (``make stack``) and the integration tests.
PostgreSQL is Debian's (``postgresql-15``): no image can be pulled here, so the
cluster is an ``initdb`` folder under the state dir, run as the ``postgres`` user
(the server refuses root) on a loopback TCP port with a password.
Every process is a stoker service (services.py): only what we started is stopped.
"""

from __future__ import annotations

import base64
import os
import secrets
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from . import prefect_home
from .services import ServiceError, free_port, is_running, start_service

PG_BIN = Path(os.environ.get("STOKER_PG_BIN", "/usr/lib/postgresql/15/bin"))
SERVER = "prefect-server"
POSTGRES = "postgres"


@dataclass(frozen=True)
class PrefectApi:
    """How a client reaches the server; ``auth`` is user:password (basic auth), never logged."""

    url: str
    auth: str = field(repr=False)

    def env(self) -> dict[str, str]:
        return {"PREFECT_API_URL": self.url, **({"PREFECT_API_AUTH_STRING": self.auth} if self.auth else {})}

    @property
    def ui_url(self) -> str:
        return self.url.removesuffix("/api")


def _prefect_bin() -> str:
    return str(Path(sys.executable).with_name("prefect"))


def _healthy(url: str, auth: str) -> bool:
    headers = {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()} if auth else {}
    req = urllib.request.Request(f"{url}/health", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def auth_string(state_dir: Path) -> str:
    """The stack's basic-auth credentials, generated once and kept (mode 600) under the state dir."""
    path = Path(state_dir) / "prefect-auth"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"stoker:{secrets.token_urlsafe(18)}")
        path.chmod(0o600)
    return path.read_text().strip()


def ensure_postgres(state_dir: Path, port: int | None = None, timeout_s: float = 60) -> str:
    """Start (or reuse) our PostgreSQL cluster; returns the async SQLAlchemy URL for Prefect."""
    if not (PG_BIN / "initdb").exists():
        raise ServiceError(f"PostgreSQL 15 is not installed ({PG_BIN}/initdb missing): run infra/prefect/stack.sh "
                           "or apt-get install -y postgresql-15")
    base = Path(state_dir) / "postgres"
    data = base / "data"
    password_file = base / "password"
    run_as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    if not (data / "PG_VERSION").exists():
        base.mkdir(parents=True, exist_ok=True)
        password_file.write_text(secrets.token_urlsafe(18))
        password_file.chmod(0o600)
        pwfile = base / ".pw-init"
        pwfile.write_text(password_file.read_text())
        if run_as:
            shutil.chown(base, "postgres")
            shutil.chown(pwfile, "postgres")
        # The state dir may sit under a root-only path: the postgres user must be able to reach it.
        for parent in base.parents:
            if parent == Path("/"):
                break
            parent.chmod(parent.stat().st_mode | 0o011)
        proc = subprocess.run([*run_as, str(PG_BIN / "initdb"), "-D", str(data), "-U", "prefect", "-A",
                               "scram-sha-256", f"--pwfile={pwfile}", "-E", "UTF8"], capture_output=True, text=True)
        pwfile.unlink(missing_ok=True)
        if proc.returncode != 0:
            raise ServiceError(f"initdb failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1]}")
    running = is_running(POSTGRES, state_dir)
    if running is None:
        port = port or free_port()
        start_service(POSTGRES, [*run_as, str(PG_BIN / "postgres"), "-D", str(data), "-h", "127.0.0.1",
                                 "-p", str(port), "-k", str(base)], port, state_dir, timeout_s=timeout_s)
    else:
        port = running.port
    password = password_file.read_text().strip()
    return f"postgresql+asyncpg://prefect:{password}@127.0.0.1:{port}/postgres"


def ensure_server(state_dir: Path, port: int | None = None, database_url: str | None = None,
                  ui: bool = False, timeout_s: float = 120, auth: bool = True) -> PrefectApi:
    """Start (or reuse) `prefect server start`, with basic auth unless auth=False (the demo's loopback server,
    Prefect's own default); SQLite under the state dir unless database_url."""
    secret = auth_string(state_dir) if auth else ""
    running = is_running(SERVER, state_dir)
    if running is not None:
        return PrefectApi(f"{running.url}/api", secret)
    port = port or free_port()
    home = Path(state_dir) / "prefect-home"
    home.mkdir(parents=True, exist_ok=True)
    env = {"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_SERVER_UI_ENABLED": "true" if ui else "false", "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
           **({"PREFECT_SERVER_API_AUTH_STRING": secret, "PREFECT_API_AUTH_STRING": secret} if auth else {})}
    if database_url:
        env["PREFECT_API_DATABASE_CONNECTION_URL"] = database_url
    prefect_home.seed(home, env)  # SQLite's comes migrated; either way, env says whether to register block types
    url = f"http://127.0.0.1:{port}/api"
    start_service(SERVER, [_prefect_bin(), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                  port, state_dir, env=env, ready=lambda: _healthy(url, secret), timeout_s=timeout_s)
    return PrefectApi(url, secret)


def ensure_worker(state_dir: Path, api: PrefectApi, pool: str, cwd: Path, env: dict[str, str] | None = None,
                  timeout_s: float = 90, type_: str = "process", name: str | None = None,
                  limit: int | None = None) -> None:
    """A worker of type ``type_`` (process, or docker: prefect-docker) polling ``pool`` (created if missing),
    running flows from ``cwd``; ``name`` tells apart several workers of one pool (default: after the pool);
    ``limit`` caps the flow runs it runs at once (its capacity: the others are left to the pool's other workers)."""
    name = name or f"prefect-worker-{pool}"
    if is_running(name, state_dir) is not None:
        return
    port = free_port()
    wenv = {**(env or {}), **api.env(), "PREFECT_WORKER_WEBSERVER_PORT": str(port),
            "PREFECT_WORKER_WEBSERVER_HOST": "127.0.0.1", "PREFECT_WORKER_QUERY_SECONDS": "2",
            "PREFECT_HOME": str(Path(state_dir) / "prefect-home-worker")}
    start_service(name, [_prefect_bin(), "worker", "start", "--pool", pool, "--type", type_, "--name", name,
                         "--with-healthcheck", *(["--limit", str(limit)] if limit else [])], port, state_dir,
                  env=wenv, cwd=cwd, timeout_s=timeout_s)
