"""`stoker down [NAME]` and `stoker status [NAME]`: parsing, dispatch and the pure pieces of their output. What
they do to real containers is tests/integration/test_down_any.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from stoker import cli
from stoker.commands.down import state_folders, summary
from stoker.commands.status import NONE_HERE, unknown_message


def test_down_takes_an_optional_name_and_dispatches_to_one_handler():
    named = cli.build_parser().parse_args(["down", "chat"])
    assert named.name == "chat" and named.fn is cli._down
    bare = cli.build_parser().parse_args(["down"])
    assert bare.name is None and bare.fn is cli._down  # the demo's down: today's behaviour


def test_down_takes_one_name_only(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(["down", "a", "b"])
    assert exc.value.code == 2 and "unrecognized arguments: b" in capsys.readouterr().err


def test_status_name_is_optional():
    assert cli.build_parser().parse_args(["status"]).name is None
    assert cli.build_parser().parse_args(["status", "chat"]).name == "chat"


def test_unknown_name_is_one_line_listing_the_known():
    msg = unknown_message("nope", ["alpha", "beta"])
    assert msg == "unknown deployment 'nope' (deployments here: alpha, beta)"
    assert unknown_message("nope", []) == "unknown deployment 'nope' (deployments here: none)"
    assert "\n" not in unknown_message("a\nb", ["c"])  # repr keeps even a hostile name on one line


def test_no_deployments_line():
    assert NONE_HERE == "no stoker deployments on this host"


def test_state_folders_are_this_home_and_mounts_shaped_like_proxy_name(tmp_path):
    home = tmp_path / "home"
    worker = tmp_path / "worker-home" / "proxy" / "chat"
    mounted = [home / "proxy" / "chat", worker, Path("/"), tmp_path / "proxy" / "other", tmp_path / "chat"]
    # Only .../proxy/chat: a label pointing elsewhere (/, another deployment's folder) is never deleted.
    assert state_folders("chat", mounted, home) == [home / "proxy" / "chat", worker]


def test_summary_counts_containers_and_names_folders():
    assert summary("chat", ["stoker-chat-proxy", "stoker-chat-blue"], [Path("/h/proxy/chat")]) == (
        "deployment chat: removed 2 container(s) and its state folder /h/proxy/chat; "
        "its runs and its artifacts in S3 stay")
    assert summary("chat", ["stoker-chat-blue"], []) == (
        "deployment chat: removed 1 container(s); its runs and its artifacts in S3 stay")
