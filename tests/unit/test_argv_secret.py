"""The argv_secret shim (stoker/containers/argv_secret.c): built once per source, and what it does to a process
named tritonserver — the placeholder replaced in its argv, the token gone from the environment its children get, a
refusal in one line when the token is missing — and to any other process: nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
import io
import tarfile

import pytest

from stoker.containers import argv_secret

TOKEN = "0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    return argv_secret.build(tmp_path_factory.mktemp("home"))


def fake(program: str, name: str = "tritonserver") -> list[str]:
    """``program`` (echo, env) run with argv[0] = ``name`` (bash's exec -a): the shim decides by argv[0]'s base name
    alone, and no Triton runs here (tests/tiers.py keeps it out of the fast tier)."""
    return ["bash", "-c", f'exec -a {name} "$0" "$@"', shutil.which(program)]


def run(argv, shim, token: str | None):
    env = {"PATH": os.environ["PATH"], "LD_PRELOAD": str(shim)}
    if token is not None:
        env[argv_secret.VARIABLE] = token
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)


def test_the_placeholder_is_replaced_in_memory_and_the_token_leaves_the_environment(tmp_path, shim):
    arg = f"--http-restricted-api=model-repository:stoker-admin={argv_secret.PLACEHOLDER}"
    echoed = run([*fake("echo"), arg, f"x{argv_secret.PLACEHOLDER}{argv_secret.PLACEHOLDER}", "plain"],
                 shim, TOKEN)
    assert echoed.returncode == 0, echoed.stderr
    assert echoed.stdout.split() == [arg.replace(argv_secret.PLACEHOLDER, TOKEN), f"x{TOKEN}{TOKEN}", "plain"]
    # env as tritonserver prints the environment main() sees, the one its children inherit.
    printed = run([*fake("env")], shim, TOKEN)
    assert printed.returncode == 0 and "LD_PRELOAD=" in printed.stdout, printed
    assert argv_secret.VARIABLE not in printed.stdout and TOKEN not in printed.stdout, printed.stdout


def test_a_tritonserver_with_the_placeholder_and_no_token_refuses_in_one_line(tmp_path, shim):
    for token in (None, ""):
        done = run([*fake("echo"), f"--key={argv_secret.PLACEHOLDER}"], shim, token)
        assert done.returncode != 0 and done.stdout == "", done
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert argv_secret.VARIABLE in done.stderr and "refused" in done.stderr, done.stderr


def test_any_other_program_is_left_alone(tmp_path, shim):
    """mpirun, its daemons and Triton's stubs pass the placeholder on; each rank named tritonserver substitutes."""
    echoed = run([*fake("echo", "mpirun"), argv_secret.PLACEHOLDER], shim, TOKEN)
    assert echoed.returncode == 0 and echoed.stdout.strip() == argv_secret.PLACEHOLDER, echoed
    printed = run([*fake("env", "python3")], shim, TOKEN)
    assert f"{argv_secret.VARIABLE}={TOKEN}" in printed.stdout, printed
    # A tritonserver without the placeholder runs as it is.
    plain = run([*fake("echo"), "--model-repository=/models"], shim, None)
    assert plain.returncode == 0 and plain.stdout.strip() == "--model-repository=/models", plain


def test_built_once_per_source_and_again_when_the_source_changes(tmp_path, monkeypatch):
    first = argv_secret.build(tmp_path)
    made = first.stat().st_mtime_ns
    assert argv_secret.build(tmp_path) == first and first.stat().st_mtime_ns == made
    changed = tmp_path / "argv_secret.c"
    changed.write_text(argv_secret.SOURCE.read_text() + "/* changed */\n")
    monkeypatch.setattr(argv_secret, "SOURCE", changed)
    second = argv_secret.build(tmp_path)
    assert second != first and second.is_file() and first.is_file()
    # Published by a rename: nothing half-written is left beside them.
    assert sorted(p.name for p in first.parent.iterdir() if not p.name.endswith(".lock")) == sorted(
        [first.name, second.name])


def test_no_compiler_is_one_line_naming_it(tmp_path):
    with pytest.raises(argv_secret.ShimUnavailable) as err:
        argv_secret.build(tmp_path, compiler="no-such-cc")
    assert "no-such-cc" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "argv_secret").exists() or not any((tmp_path / "argv_secret").glob("*.so"))


def test_a_source_the_compiler_refuses_is_one_line(tmp_path, monkeypatch):
    broken = tmp_path / "argv_secret.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(argv_secret, "SOURCE", broken)
    with pytest.raises(argv_secret.ShimUnavailable) as err:
        argv_secret.build(tmp_path / "home")
    assert "could not build" in str(err.value) and "\n" not in str(err.value)
    assert not list((tmp_path / "home" / "argv_secret").glob("*.so"))


def test_the_archive_holds_the_shim_at_its_container_path(shim):
    with tarfile.open(fileobj=io.BytesIO(argv_secret.archive(shim))) as tar:
        names = {m.name: m for m in tar.getmembers()}
        inside = argv_secret.CONTAINER_PATH.removeprefix(os.path.dirname(argv_secret.CONTAINER_DIR) + "/")
        assert names[inside].mode == 0o644 and tar.extractfile(inside).read() == shim.read_bytes()
        assert names[os.path.dirname(inside)].isdir()
