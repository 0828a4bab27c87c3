"""`stoker down NAME`: remove one deployment stoker started on this host's Docker daemon, and nothing else.

What goes: every container carrying stoker's managed label and that deployment's name (proxy, backends, OpenAI
service; ``docker_engine.remove_deployment``), then the proxy's state folder (``<STOKER_HOME>/proxy/NAME``: the
HAProxy config, its admin socket, the OpenAI service's code and tokenizer files). What stays: other deployments,
containers stoker did not label, the deployment's runs under ``<STOKER_HOME>/runs`` and its artifacts in S3 (they
are history, and what `stoker rollback` would need after a new deploy). `stoker down` without a name is the
demo's (``stoker.demo.down``).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

from ..errors import StokerError


class DownIncomplete(StokerError):
    """The containers went, but a state folder could not be removed."""


def state_folders(name: str, mounted: Iterable[Path], home: Path) -> list[Path]:
    """The folders holding ``name``'s proxy state: the one this STOKER_HOME keeps, and any bind-mounted into its
    containers (a worker with its own STOKER_HOME on this host). Only a path shaped ``.../proxy/NAME`` qualifies:
    a label anyone can set must never point stoker at some other folder to delete."""
    out: list[Path] = []
    for p in (home / "proxy" / name, *mounted):
        if p.name == name and p.parent.name == "proxy" and p not in out:
            out.append(p)
    return out


def summary(name: str, containers: list[str], folders: list[Path]) -> str:
    gone = f"removed {len(containers)} container(s)"
    if folders:
        gone += f" and its state folder{'s' if len(folders) > 1 else ''} {', '.join(map(str, folders))}"
    return f"deployment {name}: {gone}; its runs and its artifacts in S3 stay"


def _remove_folder(p: Path) -> str | None:
    """None when ``p`` is gone; else why not (a file a container wrote as another user, say)."""
    errors: list[str] = []
    # onerror (3.11's hook): keep going past a file that will not go, so as much as possible is removed.
    shutil.rmtree(p, onerror=lambda _fn, path, exc: errors.append(f"{path}: {exc[0].__name__}"))
    return errors[0] if errors and p.exists() else None


def take_down(name: str, docker_host: str | None = None, log=print) -> list[str]:
    """Remove deployment ``name`` (see the module's doc); logs one line per container; returns the summary line.
    An unknown name raises ``UnknownDeployment`` (one line listing the known) before anything is touched."""
    from ..containers import engine
    from ..run import stoker_home
    from ..serving import haproxy
    from .status import require_known

    client = engine.connect(docker_host)
    require_known(client, name)
    # Read the mounts before the containers go: afterwards nothing records where their state was.
    mounted = [m for c in engine.containers(client, name) if (m := engine.state_mount(c, haproxy.MOUNT))]
    removed = engine.remove_deployment(client, name, lambda _m: None)
    for c in removed:
        log(f"removed container {c}")
    # After the containers: the proxy and the OpenAI service write into the folder while they run.
    folders = [p for p in state_folders(name, mounted, stoker_home()) if p.is_dir()]
    for p in folders:
        why = _remove_folder(p)
        if why:
            raise DownIncomplete(f"deployment {name}: removed {len(removed)} container(s), but its state folder {p} "
                                 f"stays ({why})")
    return summary(name, removed, folders)


def handler(args) -> int:
    print(take_down(args.name))
    return 0
