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


# Package and image hosts: the builds take mirrors from this machine's apt and pip configuration
# (stoker/stack/mirrors.py). nvcr.io names the GPU serving images the product itself requires.
PACKAGE_HOSTS = ("deb.debian.org", "security.debian.org", "ftp.debian.org", "pypi.org", "pythonhosted.org",
                 "registry-1.docker.io", "hub.docker.com", "ghcr.io", "quay.io")


def test_no_package_host_is_named_in_readme_makefile_infra_or_stoker():
    root = PROXY_DIR.parents[1]
    files = [root / "README.md", root / "Makefile", *(root / "infra").rglob("*"), *(root / "stoker").rglob("*")]
    found = [f"{p.relative_to(root)}: {host}" for p in files if p.is_file() and "__pycache__" not in p.parts
             for host in PACKAGE_HOSTS if host in p.read_text(errors="replace")]
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
