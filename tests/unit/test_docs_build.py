"""The documentation holds together: `mkdocs build --strict` passes (every page in the nav, every link and anchor
between pages resolves; docs/index.md includes README.md, so the README's links are checked as the site sees them),
and every relative link in README.md resolves on GitHub too (a file of the checkout, and a heading of it when the
link names one). The README stays a ten-minute read and starts with the two set-up commands.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

# [text](target) and [text](target "title"); images too. Code spans and fenced blocks are removed first.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _prose(markdown: str) -> str:
    """The markdown without fenced code blocks and code spans, where a `[x](y)` is not a link."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", markdown, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def _github_anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link keeps its text
    text = re.sub(r"[`*_~]", "", text).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(markdown: str) -> set[str]:
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S),
                          flags=re.M)
    seen: dict[str, int] = {}
    out = set()
    for h in headings:
        slug = _github_anchor(h)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_mkdocs_build_strict(tmp_path):
    mkdocs = Path(sys.executable).parent / "mkdocs"
    assert mkdocs.exists(), f"{mkdocs} is missing: install the dev extra (pip install -e '.[dev]')"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    problems = "\n".join(line for line in output.splitlines() if "WARNING" in line or "ERROR" in line)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{problems or output[-4000:]}"
    assert (tmp_path / "site" / "index.html").exists()


def test_every_page_is_in_the_nav():
    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = set()
    for entry in config["nav"]:
        listed.update(entry.values() if isinstance(entry, dict) else [entry])
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert pages == listed, f"pages not in mkdocs.yml's nav: {sorted(pages - listed)}; missing: {sorted(listed - pages)}"


def test_readme_relative_links_resolve():
    broken = []
    links = LINK.findall(_prose(README.read_text()))
    assert links, "README.md links to no page"
    for target in links:
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (ROOT / path).resolve() if path else README
        if not file.exists():
            broken.append(f"{target}: no file {path}")
            continue
        if anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
            broken.append(f"{target}: {file.relative_to(ROOT)} has no heading #{anchor}")
    assert not broken, "README.md links that do not resolve:\n" + "\n".join(broken)


def test_readme_links_to_every_docs_page():
    linked = {t.partition("#")[0] for t in LINK.findall(_prose(README.read_text()))}
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md") if p.name != "index.md"}
    assert not pages - linked, f"README.md does not link to {sorted(pages - linked)}"


def test_readme_is_a_ten_minute_read_that_starts_with_the_two_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail to docs/ (at most 250)"
    assert lines[2:6] == [
        "```bash",
        "make demo   # set up everything on a fresh machine, then run the CPU reference demo on its embedded defaults",
        "make test   # set up everything on a fresh machine, then run the whole test suite",
        "```",
    ]
