"""The registry-free images: build them only when needed.

The Triton CPU image (infra/image/build.sh) carries label ``ai.stoker.recipe`` =
digest of every file in infra/image (scripts, pinned versions, smoke model). The
proxy image (infra/proxy/Dockerfile: Debian's HAProxy on that image) carries the
digest of infra/proxy and of the base image's id. A missing image or a different
label triggers a build; otherwise the existing image is used as is.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path

import docker.errors
import requests

from stoker.containers.engine import DeployError, connect
from stoker.record.progress import Progress
from stoker.stack.mirrors import MirrorNotFound, host_debian_mirror

IMAGE_DIR = Path(__file__).resolve().parents[2] / "infra" / "image"
BUILD_SH = IMAGE_DIR / "build.sh"
DEFAULT_IMAGE = "stoker/triton-cpu:2.51.0-cpu"
PROXY_DIR = IMAGE_DIR.parent / "proxy"
DEFAULT_PROXY_IMAGE = "stoker/haproxy:2.6"
RECIPE_LABEL = "ai.stoker.recipe"
BASE_LABEL = "ai.stoker.base-image"
_RUN_FAILED = re.compile(r"^The command '.*' returned a non-zero code: (\d+)$")
# build.sh's progress: "[build  12s] chroot: venv + Python packages". Its phases, in order; "done:" ends it.
_BUILD_SH_STEP = re.compile(r"^\[build\s+\d+s\] (.*)$")
BUILD_SH_PHASES = ("base rootfs", "chroot:", "docker import", "smoke test", "done:")
# The daemon's classic builder: "Step 3/9 : RUN ...".
_DOCKER_STEP = re.compile(r"^Step (\d+)/(\d+) : ")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
BUILD_TIMEOUT_S = 1800
TAIL_LINES = 30


class ImageBuildFailed(DeployError):
    """An image build failed; the message's first line is the cause."""


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
    current, _old = _current(client, name, want, "a few minutes the first time", log)
    if current:
        return current
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
    # Our interpreter has pip, so its `pip config list` names this machine's index (the system python3
    # may have no pip at all).
    env.setdefault("STOKER_PYTHON", sys.executable)
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
    # build.sh's own step lines are the plain-text progress; the bar and the artifact count its phases.
    steps = Progress(f"image {name}", len(BUILD_SH_PHASES) - 1, "step", log, lines=False)
    say = steps.printer(log)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            say(line)
            phase = build_sh_phase(line)
            if phase is not None:
                steps.update(*phase)
        rc = proc.wait()
    finally:
        timer.cancel()
        steps.close(ok=proc.returncode == 0)
    if rc != 0:
        last = next((ln for ln in reversed(tail) if ln.strip()), "")
        cause = "timed out" if rc == -9 else f"exit status {rc}"
        raise ImageBuildFailed(
            f"image build of {name} failed ({cause}): {last.strip()}\n"
            + "\n".join(tail)
        )


def build_sh_phase(line: str) -> tuple[int, str] | None:
    """(phases done, what starts now) for one of build.sh's phase lines, else None."""
    m = _BUILD_SH_STEP.match(line.strip())
    if m is None:
        return None
    what = m.group(1)
    for done, phase in enumerate(BUILD_SH_PHASES):
        if what.startswith(phase):
            return done, phase.rstrip(":")
    return None


def docker_build_step(line: str) -> tuple[int, int] | None:
    """(step, of) for a classic `docker build` step line ("Step 3/9 : RUN ..."), else None."""
    m = _DOCKER_STEP.match(line.strip())
    return (int(m.group(1)), int(m.group(2))) if m else None


def _current(client, name: str, want: str, cost: str, log: Callable[[str], None]) -> tuple[str | None, str | None]:
    """(id of ``name`` when its recipe label is ``want``, else None; the id of an outdated image, else None)."""
    try:
        image = client.images.get(name)
    except docker.errors.ImageNotFound:
        log(f"image {name} not found: building it ({cost})")
        return None, None
    have = (image.labels or {}).get(RECIPE_LABEL)
    if have == want:
        log(f"image {name} is up to date (recipe {want[:12]})")
        return image.id, None
    log(f"image {name} has recipe {str(have)[:12]}, want {want[:12]}: rebuilding")
    return None, image.id


def proxy_recipe_digest(base_id: str, proxy_dir: Path = PROXY_DIR) -> str:
    """Digest of the proxy recipe folder and the base image's id: a rebuilt base rebuilds the proxy."""
    return hashlib.sha256(f"{recipe_digest(proxy_dir)}\nbase {base_id}\n".encode()).hexdigest()


def ensure_proxy_image(image: str = DEFAULT_PROXY_IMAGE, docker_host: str | None = None,
                       log: Callable[[str], None] = print, base: str = DEFAULT_IMAGE) -> str:
    """Return the id of the HAProxy image ``image``, building it (and its base ``base``) when needed.

    apt inside the build uses this machine's Debian mirror. Raises DockerUnavailable, or
    ImageBuildFailed (no apt source for the suite; a failed build step, named in one line).
    """
    base_id = ensure_image(base, docker_host, log)
    client = connect(docker_host)
    want = proxy_recipe_digest(base_id)
    current, old_id = _current(client, image, want, f"from {base}, apt-get install haproxy, ~1 min", log)
    if current:
        return current

    suite = _pin("SUITE")
    try:
        mirror = host_debian_mirror(suite)
    except MirrorNotFound as err:
        raise ImageBuildFailed(f"cannot build {image}: {err}") from None
    log(f"[proxy] docker build {PROXY_DIR} (base {base}, Debian {suite} from {mirror})")
    _docker_build(client, image, {"BASE_IMAGE": base_id, "DEBIAN_MIRROR": mirror, "SUITE": suite},
                  {RECIPE_LABEL: want, BASE_LABEL: base_id}, log)
    new_id = client.images.get(image).id
    if old_id and old_id != new_id:
        try:  # best effort: a container may still run the old proxy
            client.images.remove(old_id)
        except docker.errors.APIError as err:
            log(f"[proxy] kept the previous image {old_id[:19]}: {_one_line(err.explanation or str(err))}")
    log(f"[proxy] done: {image} {new_id[:19]}")
    return new_id


def _pin(name: str, versions: Path = IMAGE_DIR / "versions.env") -> str:
    """One NAME=value pin of the Triton image, so the proxy's apt suite is the base image's."""
    for line in versions.read_text().splitlines():
        if line.startswith(f"{name}="):
            return line.split("=", 1)[1].strip()
    raise ImageBuildFailed(f"{versions}: no {name}= line")


def _docker_build(client, image: str, buildargs: dict[str, str], labels: dict[str, str],
                  log: Callable[[str], None], path: Path = PROXY_DIR, network_mode: str | None = None) -> None:
    """docker build of ``path`` (default PROXY_DIR) tagged ``image``; a failed build leaves an existing tag where
    it was."""
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    steps: Progress | None = None  # the step count is known from the first step line
    say, ok = log, False
    try:
        for chunk in client.api.build(path=str(path), tag=image, buildargs=buildargs, labels=labels,
                                      rm=True, forcerm=True, pull=False, decode=True, timeout=BUILD_TIMEOUT_S,
                                      network_mode=network_mode):
            if "error" in chunk:
                detail = _one_line((chunk.get("errorDetail") or {}).get("message") or chunk["error"])
                # The daemon quotes the whole RUN command; its exit status and last output say more.
                detail = _RUN_FAILED.sub(r"a RUN step exited \1", detail)
                raise ImageBuildFailed(f"image build of {image} failed: {detail}"
                                       + (f" (last output: {tail[-1]})" if tail else ""))
            for line in _ANSI.sub("", str(chunk.get("stream", ""))).splitlines():
                # The daemon's own bookkeeping lines say nothing a reader needs.
                if line.strip() and not line.startswith((" ---> ", "Removing intermediate container")):
                    tail.append(line.strip())
                    step = docker_build_step(line)
                    if step is not None and steps is None:
                        # The step lines are the plain-text progress; the bar and the artifact count them.
                        steps = Progress(f"image {image}", step[1], "step", log, lines=False)
                        say = steps.printer(log)
                    say(f"    {line.rstrip()}")
                    if step is not None and steps is not None:
                        steps.update(step[0] - 1, line.split(" : ", 1)[-1].strip()[:40])
        ok = True
    except (docker.errors.APIError, docker.errors.BuildError, requests.exceptions.RequestException) as err:
        raise ImageBuildFailed(f"image build of {image} failed: {_one_line(str(err))}") from err
    finally:
        if steps is not None:
            steps.close(ok=ok)


def _one_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0]
