"""The argv_secret shim (argv_secret.c beside this file): builds it on this host, and says how a backend carries it.

Triton takes its admin key only as a command-line argument, and a process's argv is readable by every local user in
/proc/PID/cmdline. A backend is therefore started with ``PLACEHOLDER`` in its arguments, the key in its environment
(``VARIABLE``) and the shim in ``LD_PRELOAD``; the shim puts the key into tritonserver's argv in memory only (the C
file says how). /proc/PID/environ is readable only by the process's owner and root, and Docker's inspect, which shows
the container's environment, is root-equivalent (the docker group) — so the key is no longer readable by any other
local user.

Compiled with this host's ``cc`` on first use, cached under stoker's home keyed by the source's hash and the flags.
The library needs glibc >= 2.34 in the image (dlsym@GLIBC_2.34): stoker's CPU and stand-in images (Debian 12,
2.36) have it; NGC 26.07 is Ubuntu 24.04 (glibc 2.39) by the project's notes, not checked here. Run on the CPU
image only, never on a GPU host. Where it cannot load, staging refuses the backend (stoker.serving.probe.admin_closed).
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from ..atomic import make_once
from ..errors import StokerError
from ..home import stoker_home

SOURCE = Path(__file__).with_name("argv_secret.c")
PLACEHOLDER = "@STOKER_ADMIN_TOKEN@"  # must match argv_secret.c
VARIABLE = "STOKER_ADMIN_TOKEN"  # must match argv_secret.c
# Inside every backend container: put there by Docker's archive API before the container starts (any image, any
# engine, local or remote). /usr/lib exists in every glibc image; the folder is stoker's own.
CONTAINER_DIR = "/usr/lib/stoker-argv-secret"
CONTAINER_PATH = f"{CONTAINER_DIR}/argv_secret.so"
FLAGS = ("-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror")
LIBS = ("-ldl",)  # dlsym lives in libc from glibc 2.34; before that in libdl
COMPILER = "cc"


class ShimUnavailable(StokerError):
    """The shim cannot be built on this host (no compiler, or the compiler refused the source)."""


def cache_key(source: bytes) -> str:
    return hashlib.sha256(source + "\0".join(FLAGS + LIBS).encode()).hexdigest()[:24]


def build(home: Path | None = None, compiler: str = COMPILER) -> Path:
    """The shim for this source, compiled once per host (an exclusive lock; published by a rename). Raises
    ShimUnavailable with one line when ``compiler`` is missing or fails."""
    source = SOURCE.read_bytes()
    out = (home or stoker_home()) / "argv_secret" / f"argv_secret-{cache_key(source)}.so"
    if out.is_file():
        return out
    cc = shutil.which(compiler)
    if cc is None:
        raise ShimUnavailable(f"no C compiler: `{compiler}` is not on PATH; stoker compiles {SOURCE.name} with it to "
                              "keep Triton's admin token off the command line (install gcc and libc6-dev: "
                              "infra/system-deps.sh)")

    def make() -> None:
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
        os.close(fd)
        try:
            done = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE), *LIBS], capture_output=True, text=True,
                                  check=False, timeout=120)
            if done.returncode != 0:
                first = (done.stderr.strip() or done.stdout.strip() or f"exit {done.returncode}").splitlines()[0]
                raise ShimUnavailable(f"`{compiler}` could not build {SOURCE.name}: {first}")
            os.chmod(tmp, 0o644)
            os.replace(tmp, out)
        finally:
            Path(tmp).unlink(missing_ok=True)

    make_once(out, out.is_file, make)
    return out


def archive(shim: Path) -> bytes:
    """A tar of ``CONTAINER_DIR`` holding the shim, for ``Container.put_archive(CONTAINER_DIR's parent, ...)``."""
    data = shim.read_bytes()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        folder = tarfile.TarInfo(Path(CONTAINER_DIR).name)
        folder.type, folder.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(folder)
        entry = tarfile.TarInfo(f"{folder.name}/{Path(CONTAINER_PATH).name}")
        entry.size, entry.mode = len(data), 0o644
        tar.addfile(entry, io.BytesIO(data))
    return buf.getvalue()


def environment(token: str) -> dict[str, str]:
    """What a backend's environment carries so that its tritonserver processes substitute ``token``."""
    return {"LD_PRELOAD": CONTAINER_PATH, VARIABLE: token}
