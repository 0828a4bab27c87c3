"""The test tiers, kept honest. `make test-fast` runs every test without a service marker (docker, triton, s3, hub,
prefect, slow): pure logic and what runs in this process or its children. Markers are the one source of a test's
tier, so a test in the wrong tier fails:
- at collection, a test that requests a service fixture without a service marker (one line naming its file);
- at run time, a fast test that starts a container, a service stoker runs (S3, Hub mirror, Prefect server or
  Prefect's temporary API, Triton, dockerd, HAProxy, PostgreSQL), or connects to the Docker daemon, errors naming
  itself.
"""

from __future__ import annotations

import os
import subprocess

import pytest

SERVICE_MARKERS = ("docker", "triton", "s3", "hub", "prefect", "slow")
# Fixtures that start or reach a service (tests/conftest.py, tests/integration/*).
SERVICE_FIXTURES = {"local_stack", "s3_server", "triton_image", "standin_image", "prefect_api", "moto", "mirror", "storage_server"}
# Programs that are services or containers; a fast test must not start them.
SERVICE_PROGRAMS = {"docker", "dockerd", "tritonserver", "moto_server", "haproxy", "postgres", "initdb"}


def is_fast(item: pytest.Item) -> bool:
    return not any(item.get_closest_marker(m) for m in SERVICE_MARKERS)


def check_collection(items: list[pytest.Item]) -> None:
    wrong = sorted({item.nodeid.split("::", 1)[0] for item in items
                    if is_fast(item) and SERVICE_FIXTURES & set(getattr(item, "fixturenames", ()))})
    if wrong:
        raise pytest.UsageError(f"tier: {', '.join(wrong)}: uses a service fixture without a service marker "
                                f"({', '.join(SERVICE_MARKERS)})")


def _refuse(nodeid: str, what: str):
    raise RuntimeError(f"tier: {nodeid} is in the fast tier (no service marker) but {what}; mark it "
                       f"({', '.join(SERVICE_MARKERS)})")


def _starts_service(argv) -> str | None:
    args = [str(a) for a in (argv if isinstance(argv, (list, tuple)) else [argv])]
    if not args:
        return None
    prog = os.path.basename(args[0])
    if prog in SERVICE_PROGRAMS:
        return prog
    if prog == "prefect" and args[1:3] == ["server", "start"]:
        return "prefect server"
    if "uvicorn" in args and any(a.startswith("prefect.server") for a in args):
        return "Prefect's temporary API"  # what a flow, or any Prefect client, starts when no API is configured
    if "olah.server" in args or "moto.server" in args or "stoker.stack.s3_persistent" in args:  # moto kept on disk
        return "a Hub mirror" if "olah.server" in args else "moto"
    return None


def guard(item: pytest.Item, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make a fast test's use of a service an error instead of a slow pass."""
    real_popen_init = subprocess.Popen.__init__

    def popen_init(self, args, *a, **kw):
        prog = _starts_service(args)
        if prog:
            _refuse(item.nodeid, f"starts {prog}")
        real_popen_init(self, args, *a, **kw)

    monkeypatch.setattr(subprocess.Popen, "__init__", popen_init)
    try:
        import docker

        def no_docker(*_a, **_kw):
            _refuse(item.nodeid, "connects to the Docker daemon")

        monkeypatch.setattr(docker, "from_env", no_docker)
        monkeypatch.setattr(docker.DockerClient, "__init__", no_docker)
    except ImportError:
        pass
