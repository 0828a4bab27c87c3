"""The worker image (infra/worker/Dockerfile): stoker + Prefect on the CPU Triton image, for the docker pool.

Built without a registry, like the proxy image: FROM the Triton CPU image this machine built. Its context is
assembled here: the Dockerfile, requirements (the project's dependencies and the heavy steps' nvidia-modelopt),
constraints (the pins of the venv that runs this, so the image runs what the tests ran), the host's CA bundle
(pip may go through an intercepting proxy), and this checkout's packages. Its recipe label covers all of that
and the base image's id, so a source change rebuilds it (the dependency layer stays cached).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Callable

from .image import (DEFAULT_IMAGE, RECIPE_LABEL, BASE_LABEL, ImageBuildFailed, _current, _docker_build,
                    ensure_image)
from .mirrors import pip_settings, read_pip_config
from ..containers.engine import connect

ROOT = Path(__file__).resolve().parents[2]
WORKER_DIR = ROOT / "infra" / "worker"
DEFAULT_WORKER_IMAGE = "stoker/worker:0.1.0"
SOURCES = ("pyproject.toml", "README.md", "stoker", "flows", "tasks")
# Of the "heavy" extra: what quantize and build import. torch, transformers and safetensors come with the base.
HEAVY = ("nvidia-modelopt", "requests")
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
_SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")


def requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    heavy = [r for r in project["optional-dependencies"]["heavy"] if r.split("=")[0].split("<")[0].strip() in HEAVY]
    return [*project["dependencies"], *heavy]


def constraints(python: str = sys.executable) -> list[str]:
    """The venv's own pins, minus what is not on an index (this project, local wheels) and what the base has."""
    frozen = subprocess.run([python, "-m", "pip", "freeze", "--exclude-editable"], capture_output=True, text=True,
                            check=True).stdout.splitlines()
    return [ln for ln in frozen if "==" in ln and " @ " not in ln and not ln.lower().startswith(("torch==", "stoker"))]


def assemble_context(out: Path) -> None:
    shutil.copy(WORKER_DIR / "Dockerfile", out / "Dockerfile")
    (out / "requirements.txt").write_text("\n".join(requirements()) + "\n")
    (out / "constraints.txt").write_text("\n".join(constraints()) + "\n")
    shutil.copy(CA_BUNDLE, out / "host-ca.crt")
    src = out / "src"
    src.mkdir()
    for name in SOURCES:
        p = ROOT / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=_SKIP)
        else:
            shutil.copy(p, src / name)


def context_digest(folder: Path, base_id: str) -> str:
    h = hashlib.sha256()
    for p in sorted(q for q in folder.rglob("*") if q.is_file()):
        h.update(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.relative_to(folder).as_posix()}\n".encode())
    h.update(f"base {base_id}\n".encode())
    return h.hexdigest()


def ensure_worker_image(image: str = DEFAULT_WORKER_IMAGE, docker_host: str | None = None,
                        log: Callable[[str], None] = print, base: str = DEFAULT_IMAGE) -> str:
    """Return the id of the worker image, building it (and its base) when its recipe changed."""
    # pip in the build uses this machine's index settings, minus host-only file:// indexes.
    settings = pip_settings(read_pip_config(), os.environ)
    args = {k: " ".join(u for u in v.split() if not u.startswith("file:"))
            for k, v in settings.items() if k in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST")}
    return ensure_derived_image(image, base, docker_host, log, assemble_context, "worker",
                                f"from {base}, pip install prefect + stoker, ~2 min",
                                buildargs={k: v for k, v in args.items() if v}, network_mode="host")


def ensure_derived_image(image: str, base: str, docker_host: str | None, log: Callable[[str], None],
                         assemble: Callable[[Path], None], tag: str, cost: str, buildargs: dict[str, str] | None = None,
                         network_mode: str | None = None, labels: dict[str, str] | None = None) -> str:
    """An image FROM the CPU image this machine built, its context made by ``assemble``: built (and its base) when
    the context's digest, with the base image's id, is not the one its recipe label records; returns its id.
    ``labels``: what the built image must also carry (set by its Dockerfile)."""
    base_id = ensure_image(base, docker_host, log)
    client = connect(docker_host)
    with tempfile.TemporaryDirectory(prefix=f"stoker-{tag}-image-") as tmp:
        ctx = Path(tmp)
        assemble(ctx)
        want = context_digest(ctx, base_id)
        current, old_id = _current(client, image, want, cost, log)
        if current:
            return current
        log(f"[{tag}] docker build (base {base})")
        _docker_build(client, image, {"BASE_IMAGE": base_id, **(buildargs or {})},
                      {RECIPE_LABEL: want, BASE_LABEL: base_id}, log, path=ctx, network_mode=network_mode)
    new = client.images.get(image)
    have = new.labels or {}
    if have.get(RECIPE_LABEL) != want or any(have.get(k) != v for k, v in (labels or {}).items()):
        raise ImageBuildFailed(f"built {image} but its labels are not the recipe's ({want[:12]})")
    if old_id and old_id != new.id:
        try:  # best effort: a running container may still use it
            client.images.remove(old_id)
        except Exception:  # noqa: BLE001
            pass
    log(f"[{tag}] done: {image} {new.id[:19]}")
    return new.id
