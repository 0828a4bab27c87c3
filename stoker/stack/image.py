"""The registry-free Triton CPU image: build it (infra/image/build.sh) only when needed.

The image carries label ``ai.stoker.recipe`` = digest of every file in
infra/image (scripts, pinned versions, smoke model). A missing image or a
different label triggers a build; otherwise the existing image is used as is.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path

import docker.errors

from stoker.docker_engine import DeployError, connect

IMAGE_DIR = Path(__file__).resolve().parents[2] / "infra" / "image"
BUILD_SH = IMAGE_DIR / "build.sh"
DEFAULT_IMAGE = "stoker/triton-cpu:2.51.0-cpu"
RECIPE_LABEL = "ai.stoker.recipe"
BUILD_TIMEOUT_S = 1800
TAIL_LINES = 30


class ImageBuildFailed(DeployError):
    """infra/image/build.sh failed; the message ends with its last output lines."""


def recipe_digest(image_dir: Path = IMAGE_DIR) -> str:
    """sha256 over "<sha256>  <relative path>" lines of the recipe files, C-sorted.

    Byte-for-byte the digest build.sh computes (sha256sum lines piped into sha256sum).
    """
    files = sorted(
        (
            p
            for p in image_dir.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
        ),
        key=lambda p: p.relative_to(image_dir).as_posix().encode(),
    )
    listing = "".join(
        f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.relative_to(image_dir).as_posix()}\n"
        for p in files
    )
    return hashlib.sha256(listing.encode()).hexdigest()


def ensure_image(name: str, docker_host: str | None, log: Callable[[str], None]) -> str:
    """Return the id of image ``name``, building it first if missing or built from another recipe.

    Raises DockerUnavailable, or ImageBuildFailed with build.sh's last lines.
    """
    client = connect(docker_host)
    want = recipe_digest()
    try:
        image = client.images.get(name)
        have = (image.labels or {}).get(RECIPE_LABEL)
        if have == want:
            log(f"image {name} is up to date (recipe {want[:12]})")
            return image.id
        log(f"image {name} has recipe {str(have)[:12]}, want {want[:12]}: rebuilding")
    except docker.errors.ImageNotFound:
        log(f"image {name} not found: building it (a few minutes the first time)")

    _run_build(name, docker_host, log)
    image = client.images.get(name)
    if (image.labels or {}).get(RECIPE_LABEL) != want:
        raise ImageBuildFailed(
            f"built {name} but its {RECIPE_LABEL} label is not {want[:12]}; "
            "were the recipe files edited during the build?"
        )
    return image.id


def _run_build(name: str, docker_host: str | None, log: Callable[[str], None]) -> None:
    env = dict(os.environ)
    if docker_host:
        env["DOCKER_HOST"] = docker_host
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    proc = subprocess.Popen(
        [str(BUILD_SH), name],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    timer = threading.Timer(
        BUILD_TIMEOUT_S, proc.kill
    )  # a hung apt/pip must not hang us
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            log(line)
        rc = proc.wait()
    finally:
        timer.cancel()
    if rc != 0:
        last = next((ln for ln in reversed(tail) if ln.strip()), "")
        cause = "timed out" if rc == -9 else f"exit status {rc}"
        raise ImageBuildFailed(
            f"image build of {name} failed ({cause}): {last.strip()}\n"
            + "\n".join(tail)
        )
