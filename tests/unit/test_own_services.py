"""Services are shared: a test file that starts a server or a container itself, outside the shared fixtures of
tests/conftest.py, is on tests/own_services.txt with its reason, or this fast test fails naming it.

Found by reading the source (a call to one of stoker's starters, a local Triton, or `containers.run`), so it
holds before any service tier runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
LISTED = TESTS / "own_services.txt"
# stoker's own starters of a service or a container, and the Docker SDK's.
STARTERS = {"ensure_s3", "ensure_mirror", "ensure_server", "ensure_postgres", "start_service", "ensure_daemon",
            "start_backend", "start_proxy", "start_openai"}


def _starts(call: ast.Call) -> str | None:
    f = call.func
    if isinstance(f, ast.Name) and f.id in STARTERS:
        return f.id
    if isinstance(f, ast.Attribute):
        if f.attr in STARTERS:
            return f.attr
        owner = f.value
        if f.attr == "start" and isinstance(owner, ast.Name) and owner.id == "local_triton":
            return "local_triton.start"
        if f.attr == "run" and isinstance(owner, ast.Attribute) and owner.attr == "containers":
            return "containers.run"
    return None


def starters() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in sorted(TESTS.rglob("*.py")):
        if path == TESTS / "conftest.py" or path == Path(__file__).resolve():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and (what := _starts(node)):
                found.setdefault(str(path.relative_to(TESTS.parent)), set()).add(what)
    return found


def listed() -> dict[str, str]:
    out = {}
    for line in LISTED.read_text().splitlines():
        name, _, reason = line.partition("#")
        if name.strip():
            out[name.strip()] = reason.strip()
    return out


def test_every_file_that_starts_its_own_service_says_why():
    found, allowed = starters(), listed()
    unlisted = [f"{f} starts {', '.join(sorted(what))}" for f, what in found.items() if f not in allowed]
    assert not unlisted, (f"own services: {unlisted[0]} outside the shared fixtures (tests/conftest.py); use them, "
                          f"or add the file to {LISTED.name} with its reason")


def test_the_list_has_a_reason_for_each_file_and_nothing_stale():
    found, allowed = starters(), listed()
    assert all(allowed.values()), [f for f, reason in allowed.items() if not reason]
    stale = sorted(set(allowed) - set(found))
    assert not stale, f"{LISTED.name}: {stale[0]} no longer starts a service of its own; remove it"
