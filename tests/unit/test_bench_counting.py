"""`stoker bench` counts tokens with a tokenizer, or says loudly that it counts chunks (issue 14 item 2)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from stoker.bench.counting import CHUNKS_WARNING, Counting, Found, NoTokenizer, choose
from stoker.bench.errors import InvalidBenchmarkConfig
from stoker.bench.output import markdown_table
from stoker.cli import main
from stoker.serving.backend_repo import parse_triton_s3
from stoker.serving.deployed_tokenizer import _from_manifest, address

FOUND = Found(Path("/runs/tok/tokenizer.json"), "deployment demo (live backend stoker-demo-blue, run r1)")


def _never() -> Found:
    raise AssertionError("the deployment must not be looked up")


def test_the_users_tokenizer_wins_and_nothing_is_looked_up():
    assert choose(Path("t.json"), False, _never) == Counting(Path("t.json"), "--tokenizer")


def test_count_chunks_is_asked_for_and_nothing_is_looked_up():
    counting = choose(None, True, _never)
    assert counting.chunks and counting.to_dict() == {"output_unit": "chunks", "source": "--count-chunks"}


def test_the_deployments_tokenizer_by_default():
    assert choose(None, False, lambda: FOUND) == Counting(FOUND.tokenizer_json, FOUND.source)


def test_without_a_tokenizer_it_refuses_in_one_line_naming_why_and_both_ways_out():
    why = "no stoker deployment on this machine's Docker daemon serves port 9"
    with pytest.raises(NoTokenizer) as info:
        choose(None, False, lambda: Found(None, why))
    message = str(info.value)
    assert "\n" not in message and why in message and "--tokenizer" in message and "--count-chunks" in message
    assert isinstance(info.value, InvalidBenchmarkConfig)


def test_both_flags_are_refused():
    with pytest.raises(InvalidBenchmarkConfig, match="not both"):
        choose(Path("t.json"), True, _never)


def test_a_counted_run_records_which_tokenizer(tmp_path):
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    assert Counting(tok, "--tokenizer").to_dict() == {
        "output_unit": "tokens", "source": "--tokenizer", "tokenizer": str(tok),
        "tokenizer_sha256": hashlib.sha256(b"{}").hexdigest()}


LEVEL = {"mode": "concurrency", "concurrency": 1, "requests": 4, "errors": 0, "output_tokens_per_s": 10.0,
         "requests_per_s": 1.0, "client_saturated": None}


def test_the_table_says_chunks_in_every_header_that_is_not_tokens():
    table = markdown_table([LEVEL], "chunks")
    caption, header = table.splitlines()[0], table.splitlines()[2]
    assert "CHUNKS, not tokens" in caption
    assert "output CHUNKS/s" in header and "ms/CHUNK p50" in header and "CHUNKS mean" in header
    assert "tok" not in header and "ITL" not in header and "OSL" not in header
    assert markdown_table([LEVEL]).startswith("| level |") and "output tok/s" in markdown_table([LEVEL])
    assert "CHUNKS" in CHUNKS_WARNING


def test_bench_refuses_without_a_tokenizer_before_sending_anything(tmp_path, capsys, monkeypatch):
    # No daemon to ask which deployment serves the port (a fast test reaches no service: tests/tiers.py).
    from stoker.containers import engine as docker_engine

    def no_daemon(*_a, **_kw):
        raise docker_engine.DockerUnavailable("no Docker daemon here")

    monkeypatch.setattr(docker_engine, "connect", no_daemon)
    monkeypatch.setenv("STOKER_HOME", str(tmp_path / "home"))
    code = main(["bench", "--url", "127.0.0.1:9", "--out", str(tmp_path / "o"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and "\n" not in err and "no tokenizer to count tokens with" in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("url", "expected"), [
    ("127.0.0.1:8001", ("127.0.0.1", 8001)),
    ("http://localhost:8000", ("localhost", 8000)),
    ("https://bench.example:443/x", ("bench.example", 443)),
    ("127.0.0.1", ("127.0.0.1", None)),
])
def test_address(url, expected):
    assert address(url) == expected


@pytest.mark.parametrize(("uri", "expected"), [
    ("s3://127.0.0.1:19000/stoker-demo/demo/repos/d98/model_repository",
     ("http://127.0.0.1:19000", "stoker-demo", "demo/repos/d98/model_repository")),
    ("s3://https://s3.example:443/b/p/model_repository/", ("https://s3.example:443", "b", "p/model_repository")),
    ("s3://my-bucket/stoker/repos/abc/model_repository", (None, "my-bucket", "stoker/repos/abc/model_repository")),
])
def test_triton_s3_uris_are_read_back(uri, expected):
    assert parse_triton_s3(uri) == expected


@pytest.mark.parametrize("where", ["preprocessing/1/tokenizer/tokenizer.json",  # the engine layout
                                   "tensorrt_llm/1/checkpoint/tokenizer.json",  # the LLM API's (no preprocessing)
                                   "tensorrt_llm/1/weights/tokenizer.json"])  # the reference build's
def test_the_manifests_tokenizer_is_used_only_when_it_is_here_unchanged(tmp_path, where):
    tok = tmp_path / "out" / where
    tok.parent.mkdir(parents=True)
    tok.write_text('{"model": {}}')
    digest = hashlib.sha256(tok.read_bytes()).hexdigest()
    manifest = {"steps": {"package": {"outputs": [
        {"uri": (tmp_path / "out" / "ensemble" / "config.pbtxt").as_uri(), "sha256": "0" * 64},
        {"uri": tok.as_uri(), "sha256": digest}]}}}
    assert _from_manifest(json.loads(json.dumps(manifest))) == tok
    tok.write_text("changed")
    assert _from_manifest(manifest) is None
    assert _from_manifest({"steps": {}}) is None
