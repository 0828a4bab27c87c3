"""A new Prefect home seeded with a database that is already migrated.

Prefect migrates a new SQLite database at its first start: about 9 s of CPU on a 2-core host, paid by every fresh
PREFECT_HOME (a new worker machine, each test's home, each server the stack starts in a new state folder). With
STOKER_PREFECT_DB_TEMPLATE naming a database that this Prefect migrated (`make_template`), a home that has no
database gets a copy of it instead, and Prefect finds it at its head revision. `make test-services` sets it
(`python -m stoker.stack.prefect_home` makes one per machine and Prefect version, and prints its path); unset, or
where Prefect uses another database, nothing changes.

The template's block types are registered too (`_register_blocks`), yet Prefect registers them again at every
server start in a new home: its memo of that work is keyed by the database's URL, which names the home. That costs
about 2 CPU-s per start (loading Prefect's collections, then writing what the database already holds), paid by
each temporary API a `stoker` process starts. A seeded home is marked (SEEDED_MARK), and the servers started on it
are told to skip the registration (`registration_env`).
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from contextlib import closing
from pathlib import Path

TEMPLATE_ENV = "STOKER_PREFECT_DB_TEMPLATE"
DB_FILE = "prefect.db"  # Prefect's default SQLite database, in PREFECT_HOME
SEEDED_MARK = ".stoker-seeded"  # beside DB_FILE: the database came from the template, block types and all
_OTHER_DB = ("PREFECT_API_DATABASE_CONNECTION_URL", "PREFECT_SERVER_DATABASE_CONNECTION_URL")
_REGISTRATION = ("PREFECT_API_BLOCKS_REGISTER_ON_START", "PREFECT_MEMOIZE_BLOCK_AUTO_REGISTRATION")


def current_home() -> Path:
    return Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect").expanduser()


def seed(home: Path | None = None, env: dict[str, str] | None = None) -> bool:
    """Copy the template database into ``home`` (default: this process's PREFECT_HOME) when it has none; ``env``
    is the environment the server will run with (default: this process's), and gets `registration_env`'s
    settings. Whether it copied."""
    env = os.environ if env is None else env
    template = env.get(TEMPLATE_ENV) or os.environ.get(TEMPLATE_ENV)
    if not template:
        return False
    home = Path(home) if home is not None else current_home()
    db = home / DB_FILE
    other_db = any(env.get(k) for k in _OTHER_DB)
    copied = not other_db and Path(template).is_file() and not db.exists()
    if copied:
        home.mkdir(parents=True, exist_ok=True)
        # A temporary name, then a rename: a server starting beside us never opens half a database.
        tmp = home / f".{DB_FILE}.{os.getpid()}.tmp"
        shutil.copyfile(template, tmp)
        (home / SEEDED_MARK).touch()  # before the database appears: a home with the database is never unmarked
        os.replace(tmp, db)
    env.update(registration_env(None if other_db else home))
    return copied


def cold_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` as a machine without the template has it: neither the template nor what seeding said about block
    registration (a test that starts a cold home inherits both from its seeded process)."""
    return {k: v for k, v in env.items() if k not in (TEMPLATE_ENV, *_REGISTRATION)}


def registration_env(home: Path | None) -> dict[str, str]:
    """Block registration off for a server on a seeded home; Prefect's defaults, said outright, for any other home
    or database (None): a child process inherits its parent's environment, and its database may be one that was
    never seeded."""
    seeded = home is not None and (home / SEEDED_MARK).exists() and (home / DB_FILE).exists()
    return dict.fromkeys(_REGISTRATION, "false" if seeded else "true")


def make_template(path: Path) -> Path:
    """Migrate a new database with this interpreter's Prefect (`prefect server database upgrade`) and publish it
    at ``path`` as one self-contained file (SQLite's backup: no WAL beside it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="stoker-prefect-template-") as tmp:
        env = {k: v for k, v in cold_env(os.environ).items() if k not in (*_OTHER_DB, "PREFECT_API_URL")}
        env["PREFECT_HOME"] = tmp  # cold: the template is where the block types come from
        prefect = Path(sys.executable).with_name("prefect")
        run = subprocess.run([str(prefect), "server", "database", "upgrade", "-y"], env=env, capture_output=True,
                             text=True, timeout=600)
        if run.returncode != 0:
            raise RuntimeError(f"prefect server database upgrade exited {run.returncode}: "
                               f"{(run.stderr or run.stdout).strip().splitlines()[-1:]}")
        _register_blocks(prefect, env)
        staged = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with closing(sqlite3.connect(Path(tmp) / DB_FILE)) as src, closing(sqlite3.connect(staged)) as dst:
            src.backup(dst)
        os.replace(staged, path)
    return path


def _register_blocks(prefect: Path, env: dict[str, str], timeout_s: float = 180) -> None:
    """Start the server once on the new database, so that its block types are registered (each start registers
    them in a database that has none: another second and a half of CPU per new home), then stop it."""
    import time
    import urllib.request

    from .services import free_port

    port = free_port()  # leased: no other pick of this host takes it meanwhile
    server = subprocess.Popen([str(prefect), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                              env={**env, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                                   "PREFECT_SERVER_UI_ENABLED": "false"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and server.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError("prefect server did not answer on the new database")
    finally:
        server.terminate()
        server.wait(timeout=60)


def default_path() -> Path:
    """Named after Prefect's version and its installed collections': a seeded server skips registering block
    types, so a collection added or upgraded needs a template of its own."""
    import hashlib
    from importlib.metadata import distributions, version

    collections = sorted(f"{d.metadata['Name']}=={d.version}" for d in distributions()
                         if (d.metadata["Name"] or "").lower().startswith("prefect-"))
    key = hashlib.sha256("\n".join(collections).encode()).hexdigest()[:8]
    return Path(tempfile.gettempdir()) / f"stoker-prefect-template-{version('prefect')}-{key}.db"


def main() -> int:
    """Print the template's path, made first when missing (one process at a time)."""
    from ..atomic import make_once

    path = Path(sys.argv[1]) if len(sys.argv) > 1 else default_path()
    make_once(path, path.is_file, lambda: make_template(path))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
