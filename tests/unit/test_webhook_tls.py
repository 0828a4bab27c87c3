"""`stoker webhook serve` serves TLS when given a certificate, and refuses plain HTTP off loopback in one line before
anything starts (the HTTPS round trip itself: tests/integration/test_operate_triggers.py's receiver)."""

from __future__ import annotations

import pytest

from stoker.cli import main
from stoker.commands.webhook import check_tls
from stoker.errors import StokerError


def test_plain_http_is_served_on_loopback_only_unless_asked_for(tmp_path):
    assert check_tls("127.0.0.1", None, None, False) is None
    assert check_tls("::1", None, None, False) is None
    assert check_tls("0.0.0.0", None, None, True) is None  # behind a TLS-terminating proxy, said in as many words
    with pytest.raises(StokerError, match=r"--host 0.0.0.0 is not loopback: serve TLS"):
        check_tls("0.0.0.0", None, None, False)
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("x")
    with pytest.raises(StokerError, match="give --tls-cert and --tls-key together"):
        check_tls("0.0.0.0", cert, None, False)
    with pytest.raises(StokerError, match=r"--tls-key .*k.pem: not a readable file"):
        check_tls("0.0.0.0", cert, key, False)
    key.write_text("y")
    assert check_tls("0.0.0.0", cert, key, False) == (cert, key)


def test_the_command_refuses_in_one_line_before_reading_specs_or_secrets(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # nothing is asked of it
    monkeypatch.delenv("STOKER_WEBHOOK_SECRET", raising=False)
    rc = main(["webhook", "serve", "--host", "0.0.0.0", "--specs", str(tmp_path / "none")])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "is not loopback: serve TLS" in err
