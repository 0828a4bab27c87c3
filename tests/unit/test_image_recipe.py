"""Recipe digests decide when an image is rebuilt (stoker/stack/image.py)."""

from __future__ import annotations

from stoker.stack.image import PROXY_DIR, proxy_recipe_digest, recipe_digest


def test_proxy_digest_follows_the_recipe_files_and_the_base_image(tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM base\n")
    first = proxy_recipe_digest("sha256:aaa", tmp_path)
    assert proxy_recipe_digest("sha256:aaa", tmp_path) == first
    assert proxy_recipe_digest("sha256:bbb", tmp_path) != first  # a rebuilt base rebuilds the proxy
    (tmp_path / "Dockerfile").write_text("FROM base\nRUN true\n")
    assert proxy_recipe_digest("sha256:aaa", tmp_path) != first


def _machine_hosts() -> set[str]:
    """The package hosts this machine's apt and pip would use — read from their configuration at test time, so
    that no file of the project needs to name one: every apt source's host (any suite), pip's configured index
    hosts and trusted hosts, and pip's own default index and file hosts."""
    import os
    import re
    from urllib.parse import urlsplit

    from pip._internal.models.index import PyPI

    from stoker.stack.mirrors import apt_source_files, pip_settings, read_pip_config

    hosts = {PyPI.netloc, PyPI.file_storage_domain}
    for path in apt_source_files():
        hosts |= {urlsplit(uri).hostname for uri in re.findall(r"\b[a-z+]+://[^\s\]]+", path.read_text(errors="replace"))}
    for value in pip_settings(read_pip_config(), os.environ).values():
        hosts |= {urlsplit(tok).hostname if "://" in tok else tok for tok in value.split()}
    return {h for h in hosts if h and "." in h and h not in ("127.0.0.1",)}


def test_no_package_host_is_named_in_any_file_of_the_project():
    """The builds take mirrors from this machine's apt and pip configuration (stoker/stack/mirrors.py)."""
    import subprocess

    root = PROXY_DIR.parents[1]
    hosts = _machine_hosts()
    assert hosts  # at least pip's own default index
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, text=True, check=True)
    files = [root / f for f in tracked.stdout.split("\0") if f]
    found = [f"{p.relative_to(root)}: {host}" for p in files if p.is_file()
             for host in hosts if host in p.read_text(errors="replace")]
    assert found == []
    assert recipe_digest(PROXY_DIR)


def test_image_pins_the_transformers_the_project_tests_against():
    """The reference runtime is transformers' own model code: the image must serve the version the tests matched."""
    import re

    root = PROXY_DIR.parents[1]
    versions = dict(line.split("=", 1) for line in (root / "infra/image/versions.env").read_text().splitlines()
                    if line and not line.startswith("#"))
    pinned = re.search(r'"transformers==([^"]+)"', (root / "pyproject.toml").read_text()).group(1)
    assert versions["TRANSFORMERS_VERSION"] == pinned
    assert '"transformers==${TRANSFORMERS_VERSION}"' in (root / "infra/image/rootfs-setup.sh").read_text()


def test_image_pins_the_xgrammar_the_project_tests_against():
    """Guided decoding runs in the image: the xgrammar the runtime's tests ran on (the venv's, which the Makefile
    installs from the same pins), both installed without `triton`."""
    from importlib.metadata import version

    root = PROXY_DIR.parents[1]
    versions = dict(line.split("=", 1) for line in (root / "infra/image/versions.env").read_text().splitlines()
                    if line and not line.startswith("#"))
    assert versions["XGRAMMAR_VERSION"] == version("xgrammar")
    assert versions["APACHE_TVM_FFI_VERSION"] == version("apache-tvm-ffi")
    assert '"xgrammar==$$XGRAMMAR_VERSION"' in (root / "Makefile").read_text()
    setup = (root / "infra/image/rootfs-setup.sh").read_text()
    assert '"xgrammar==${XGRAMMAR_VERSION}"' in setup and "--no-deps" in setup
