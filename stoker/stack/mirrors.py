"""Package mirrors as this machine's own apt and pip configuration names them.

The image builds take their Debian mirror and Python package index from here, so
the repository names no package host and a build works wherever apt and pip are
set up. Standard library only: infra/image/build.sh runs this file with the
system python3, before any virtualenv exists.

    python3 stoker/stack/mirrors.py debian [SUITE]   # the URI serving SUITE's main component
    python3 stoker/stack/mirrors.py pip-env          # NAME=VALUE lines: PIP_INDEX_URL, …
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

APT_ETC = Path("/etc/apt")
SUITE = "bookworm"
# Schemes debootstrap and apt's plain http/file methods fetch from (not cdrom:, not mirror+…).
MIRROR_SCHEMES = ("http://", "https://", "file:/")
# pip settings the image builds follow; find-links is left out on purpose: it names host folders,
# and the build hands the one wheel it needs from there (torch) to the chroot itself.
PIP_KEYS = ("index-url", "extra-index-url", "trusted-host")
_ONE_LINE = re.compile(r"^deb\s+(?:\[[^\]]*\]\s+)?(?P<uri>\S+)\s+(?P<suite>\S+)(?P<components>(?:\s+\S+)*)\s*$")


class MirrorNotFound(Exception):
    """No apt source serves the wanted suite's main component."""


def apt_source_files(etc: Path = APT_ETC) -> list[Path]:
    """The files apt itself reads, in its order: sources.list, then sources.list.d/*.list|*.sources sorted.

    Anything else there (``*.disabled``, ``*.save``, …) apt ignores, and so do we.
    """
    files = [etc / "sources.list"] if (etc / "sources.list").is_file() else []
    d = etc / "sources.list.d"
    if d.is_dir():
        files += sorted(p for p in d.iterdir() if p.is_file() and p.suffix in (".list", ".sources"))
    return files


def debian_mirror(sources: Iterable[tuple[str, str]], suite: str = SUITE, component: str = "main") -> str:
    """The first URI serving ``suite``'s ``component``, from (file name, text) pairs in apt's order.

    ``.sources`` files are deb822 stanzas (Types/URIs/Suites/Components, ``Enabled: no`` skipped); others are
    one-line ``deb [options] URI suite components…``. Raises MirrorNotFound.
    """
    for name, text in sources:
        entries = _deb822(text) if name.endswith(".sources") else _one_line(text)
        for uri, suites, components in entries:
            if suite in suites and component in components and uri.startswith(MIRROR_SCHEMES):
                return uri.rstrip("/")
    raise MirrorNotFound(f"no apt source serves '{suite} {component}'")


def _one_line(text: str) -> Iterable[tuple[str, list[str], list[str]]]:
    for line in text.splitlines():
        m = _ONE_LINE.match(line.split("#", 1)[0].strip())
        if m:
            yield m["uri"], [m["suite"]], m["components"].split()


def _deb822(text: str) -> Iterable[tuple[str, list[str], list[str]]]:
    for stanza in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        key = None
        for line in stanza.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            if line[0].isspace() and key:  # a continuation line of a multi-line field
                fields[key] += " " + line.strip()
            elif ":" in line:
                key, value = line.split(":", 1)
                key = key.strip().lower()
                fields[key] = value.strip()
        if "deb" not in fields.get("types", "").split() or fields.get("enabled", "yes").lower() == "no":
            continue
        suites, components = fields.get("suites", "").split(), fields.get("components", "").split()
        for uri in fields.get("uris", "").split():
            yield uri, suites, components


def pip_settings(config_list: str, environ: Mapping[str, str]) -> dict[str, str]:
    """PIP_* variables for index-url, extra-index-url and trusted-host, as pip itself would resolve them.

    ``config_list`` is the output of ``pip config list`` (``section.key='value'`` lines). Precedence is pip's:
    environment, then the ``install`` section, then ``global``. Unset keys are left out, so pip's own
    default index applies.
    """
    found: dict[str, dict[str, str]] = {}
    for line in config_list.splitlines():
        m = re.match(r"^(?P<section>[^.=]*)\.(?P<key>[^=]+)=(?P<value>.*)$", line.strip())
        if m and m["key"] in PIP_KEYS:
            try:
                value = ast.literal_eval(m["value"])  # pip prints repr() of the value
            except (ValueError, SyntaxError):
                continue
            found.setdefault(m["key"], {})[m["section"]] = str(value)
    out = {}
    for key in PIP_KEYS:
        var = "PIP_" + key.upper().replace("-", "_")
        sections = found.get(key, {})
        value = environ.get(var) or sections.get(":env:") or sections.get("install") or sections.get("global")
        if value and value.strip():
            out[var] = " ".join(value.split())
    return out


def read_pip_config(python: str = sys.executable) -> str:
    """``pip config list`` of ``python``; empty when that interpreter has no pip (the environment still counts)."""
    try:
        r = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return r.stdout if r.returncode == 0 else ""


def host_debian_mirror(suite: str = SUITE, etc: Path = APT_ETC) -> str:
    """This machine's mirror for ``suite`` main; MirrorNotFound names where it looked."""
    files = apt_source_files(etc)
    try:
        return debian_mirror(((p.name, p.read_text(errors="replace")) for p in files), suite)
    except MirrorNotFound as err:
        looked = ", ".join(str(p) for p in files) or f"nothing under {etc}"
        raise MirrorNotFound(f"{err} (read {looked})") from None


def main(argv: list[str]) -> int:
    if argv[:1] == ["debian"] and len(argv) <= 2:
        try:
            print(host_debian_mirror(*(argv[1:] or [SUITE])))
        except MirrorNotFound as err:
            print(f"mirrors: {err}", file=sys.stderr)
            return 1
        return 0
    if argv == ["pip-env"]:
        for var, value in pip_settings(read_pip_config(), os.environ).items():
            print(f"{var}={value}")
        return 0
    print("usage: mirrors.py debian [SUITE] | pip-env", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
