"""The image builds' mirrors come from this machine's apt and pip configuration (stoker/stack/mirrors.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from stoker.stack import mirrors
from stoker.stack.mirrors import MirrorNotFound, apt_source_files, debian_mirror, host_debian_mirror, pip_settings

DEB822 = """\
Types: deb
# a snapshot, kept as a comment
URIs: http://mirror.example/debian/
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://mirror.example/debian-security
Suites: bookworm-security
Components: main
"""


def test_deb822_picks_the_stanza_serving_bookworm_main():
    assert debian_mirror([("debian.sources", DEB822)]) == "http://mirror.example/debian"


def test_deb822_skips_disabled_deb_src_and_other_components():
    text = """\
Types: deb-src
URIs: http://src.example/debian
Suites: bookworm
Components: main

Types: deb
URIs: http://off.example/debian
Suites: bookworm
Components: main
Enabled: no

Types: deb
URIs: http://contrib.example/debian
Suites: bookworm
Components: contrib

Types: deb
URIs: http://first.example/debian
  http://second.example/debian
Suites: bookworm
Components: main contrib
"""
    assert debian_mirror([("x.sources", text)]) == "http://first.example/debian"


def test_one_line_format_with_options_and_comments():
    text = """\
# deb http://commented.example/debian bookworm main
deb-src http://src.example/debian bookworm main
deb [arch=amd64 signed-by=/usr/share/keyrings/k.gpg] http://updates.example/debian bookworm-updates main
deb [arch=amd64 signed-by=/usr/share/keyrings/k.gpg] https://one.example/debian bookworm main contrib # tail
"""
    assert debian_mirror([("sources.list", text)]) == "https://one.example/debian"


def test_first_file_in_apts_order_wins_and_other_suites_are_refused():
    files = [("sources.list", "deb http://a.example/debian bookworm main\n"), ("b.sources", DEB822)]
    assert debian_mirror(files) == "http://a.example/debian"
    with pytest.raises(MirrorNotFound, match="trixie main"):
        debian_mirror(files, suite="trixie")


def test_apt_source_files_ignores_what_apt_ignores(tmp_path):
    d = tmp_path / "sources.list.d"
    d.mkdir()
    (d / "debian.sources").write_text(DEB822)
    (d / "other.list.disabled-by-farm").write_text("deb http://off.example/debian bookworm main\n")
    (d / "old.sources.save").write_text("Types: deb\nURIs: http://save.example/debian\nSuites: bookworm\n"
                                        "Components: main\n")
    (d / "a.list").write_text("deb http://cloud.example/apt cloud-sdk-bookworm main\n")
    assert [p.name for p in apt_source_files(tmp_path)] == ["a.list", "debian.sources"]
    assert host_debian_mirror(etc=tmp_path) == "http://mirror.example/debian"


def test_no_source_is_one_line_naming_what_was_read(tmp_path):
    (tmp_path / "sources.list").write_text("deb http://old.example/debian bullseye main\n")
    with pytest.raises(MirrorNotFound) as err:
        host_debian_mirror(etc=tmp_path)
    assert "\n" not in str(err.value) and str(tmp_path / "sources.list") in str(err.value)


CONFIG_LIST = """\
:env:.cert='/etc/ssl/certs/ca-certificates.crt'
:env:.find-links='/opt/wheels'
global.extra-index-url='file:///srv/pypi/simple file:///srv/more/simple'
global.find-links='/opt/wheels'
global.index-url='https://global.example/simple'
install.index-url='https://install.example/simple'
global.trusted-host='global.example'
"""


def test_pip_settings_follow_pips_precedence_and_skip_find_links():
    assert pip_settings(CONFIG_LIST, {}) == {
        "PIP_INDEX_URL": "https://install.example/simple",
        "PIP_EXTRA_INDEX_URL": "file:///srv/pypi/simple file:///srv/more/simple",
        "PIP_TRUSTED_HOST": "global.example",
    }
    env = {"PIP_INDEX_URL": "https://env.example/simple", "PIP_EXTRA_INDEX_URL": ""}
    assert pip_settings(CONFIG_LIST + ":env:.extra-index-url='https://e.example/s'\n", env)["PIP_INDEX_URL"] == \
        "https://env.example/simple"
    assert pip_settings(CONFIG_LIST + ":env:.extra-index-url='https://e.example/s'\n", env)[
        "PIP_EXTRA_INDEX_URL"] == "https://e.example/s"


def test_pip_settings_without_any_config_leave_pips_default():
    assert pip_settings("", {}) == {}
    # Without pip (no `pip config list`), the environment still counts.
    assert pip_settings("", {"PIP_EXTRA_INDEX_URL": " a  b "}) == {"PIP_EXTRA_INDEX_URL": "a b"}


def test_runs_as_a_plain_script_with_one_line_errors():
    """build.sh calls the file with the system python3, outside any package import."""
    r = subprocess.run([sys.executable, "-I", mirrors.__file__, "debian", "no-such-suite"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("mirrors: no apt source serves 'no-such-suite main'") and r.stderr.count("\n") == 1
    r = subprocess.run([sys.executable, "-I", mirrors.__file__, "bogus"], capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr
