"""A local Hugging Face Hub: olah in offline mode, serving git repos that we publish ourselves.

The real Hub is unreachable here; olah speaks the Hub's HTTP API (model_info, tree listing,
resolve/download) over plain git repos at ``REPOS/models/ORG/NAME`` with a ``main`` branch,
so huggingface_hub clients run unchanged with ``HF_ENDPOINT`` pointed at it.
Every publish is a git commit, so a new publish is a new revision sha.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from stoker.stack.services import ServiceError, reuse_or_port, start_service

SERVICE_NAME = "hub-mirror"

# Fixed identity so publishing works without any git configuration on the machine.
_GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "stoker",
    "GIT_AUTHOR_EMAIL": "stoker@localhost",
    "GIT_COMMITTER_NAME": "stoker",
    "GIT_COMMITTER_EMAIL": "stoker@localhost",
}


class PublishError(ServiceError):
    """A git operation while publishing a model repo failed."""


def mirror_dir(state_dir: Path) -> Path:
    return Path(state_dir) / "hub"


def repos_dir(state_dir: Path) -> Path:
    """Where publish_model puts repos for the mirror of state_dir."""
    return mirror_dir(state_dir) / "repos"


def render_config(port: int, repos: Path, cache: Path) -> str:
    """olah's TOML config for offline serving of the git repos under repos."""
    netloc = f"127.0.0.1:{port}"
    return (
        "[basic]\n"
        'host = "127.0.0.1"\n'
        f"port = {port}\n"
        f'mirror-netloc = "{netloc}"\n'
        f'mirror-lfs-netloc = "{netloc}"\n'
        f'repos-path = "{cache}"\n'
        f'mirrors-path = ["{repos}"]\n'
        # Branch -> sha answers must follow new commits at once, not after a 10 min TTL.
        "metadata-cache-ttl = 0\n"
        "\n"
        "[accessibility]\n"
        "offline = true\n"
    )


def _answers_revision_api(endpoint: str) -> bool:
    """True once olah's API routes respond (a 404 for an unknown repo counts as responding)."""
    try:
        with urllib.request.urlopen(f"{endpoint}/api/models/stoker-probe/none/revision/main", timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


def ensure_mirror(state_dir: Path, port: int | None = None, timeout_s: float = 60) -> str:
    """Start the olah mirror on 127.0.0.1:port (a free port if None), or reuse ours; returns its endpoint.

    Serves the repos under repos_dir(state_dir).

    Raises:
        ServiceError: ours already runs on a different port, or it failed to start
            (PortInUse if the port is held by something else).
    """
    running, port = reuse_or_port(SERVICE_NAME, state_dir, port)
    if running is not None:
        return running.url
    base = mirror_dir(state_dir)
    for sub in ("repos", "cache", "logs"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    config = base / "olah.toml"
    config.write_text(render_config(port, repos_dir(state_dir).resolve(), (base / "cache").resolve()))
    endpoint = f"http://127.0.0.1:{port}"
    start_service(
        SERVICE_NAME,
        [
            sys.executable, "-m", "olah.server",
            "-c", str(config.resolve()),
            # olah's own log files; default is ./logs of the working directory.
            "--log-path", str((base / "logs").resolve()),
        ],
        port,
        state_dir,
        ready=lambda: _answers_revision_api(endpoint),
        timeout_s=timeout_s,
        cwd=base,
    )
    return endpoint


def _git(repo: Path, *args: str) -> str:
    result = subprocess.run(
        ["git", *args],
        cwd=repo,
        env={**os.environ, **_GIT_IDENTITY},
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        detail = (result.stderr or result.stdout).strip().splitlines()
        raise PublishError(f"git {' '.join(args)} failed in {repo}: {detail[-1] if detail else result.returncode}")
    return result.stdout.strip()


def publish_model(repos: Path, repo_id: str, src_dir: Path, message: str) -> str:
    """Make repo_id's main branch hold exactly the files of src_dir, as a new commit; returns its sha.

    Creates the git repo at repos/models/ORG/NAME on first publish. Files are plain git blobs
    (no LFS): olah serves blobs directly, and LFS is not installed here. Publishing identical
    content again still makes a new commit, i.e. a new revision.
    """
    org, sep, name = repo_id.partition("/")
    if not sep or not org or not name or "/" in name:
        raise PublishError(f"repo id must be ORG/NAME, got {repo_id!r}")
    src_dir = Path(src_dir)
    if not src_dir.is_dir():
        raise PublishError(f"source directory {src_dir} does not exist")
    repo = Path(repos) / "models" / org / name
    if not (repo / ".git").is_dir():
        repo.mkdir(parents=True, exist_ok=True)
        _git(repo, "init", "-q", "-b", "main")
    # Replace the working tree with src_dir so files removed from the source disappear too.
    for entry in repo.iterdir():
        if entry.name == ".git":
            continue
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    shutil.copytree(src_dir, repo, dirs_exist_ok=True)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "--allow-empty", "-m", message)
    return _git(repo, "rev-parse", "HEAD")
