"""The local stack against real processes: service lifecycle, moto S3, the olah Hub mirror, stoker.storage.hub."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from stoker.storage import hub
from stoker.record import progress
from stoker.stack import hub_mirror, s3server, services
from stoker.workers import tinymodel

TOKEN = "hf_integration_secret_token_value"


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    state = tmp_path / "state"
    state.mkdir()
    yield state
    services.stop_all(state)


@pytest.fixture
def bystander() -> Iterator[subprocess.Popen]:
    """A process that is none of our services; nothing may stop it."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


def _http_server_argv(port: int) -> list[str]:
    return [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)]


# --- services -----------------------------------------------------------------------------


def test_service_start_reuse_stop(state_dir: Path) -> None:
    port = services.free_port()
    handle = services.start_service("web", _http_server_argv(port), port, state_dir, timeout_s=30)
    assert services.port_open(port) and not services.port_free(port)
    record = json.loads((state_dir / "run" / "web.json").read_text())
    assert record["pid"] == handle.pid and record["port"] == port and record["argv"] == handle.argv
    assert services.is_running("web", state_dir) == handle
    # Starting again on the same port returns the running process instead of a second one.
    assert services.start_service("web", _http_server_argv(port), port, state_dir).pid == handle.pid

    assert services.stop_service("web", state_dir) is True
    assert services.is_running("web", state_dir) is None
    assert not (state_dir / "run" / "web.json").exists()
    # The connection port_open() made may still be closing in the kernel (LAST_ACK) for a moment after the
    # process is gone, and it holds the port until then: give it a few seconds, as a restart would.
    deadline = time.monotonic() + 5
    while not services.port_free(port) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert services.port_free(port)
    assert services.stop_service("web", state_dir) is False


def test_service_that_dies_reports_cause_and_log(state_dir: Path) -> None:
    port = services.free_port()
    argv = [sys.executable, "-c", "import sys; print('config file is broken'); sys.exit(3)"]
    with pytest.raises(services.ServiceDied) as info:
        services.start_service("broken", argv, port, state_dir, timeout_s=30)
    first_line, _, tail = str(info.value).partition("\n")
    assert "status 3" in first_line and "broken" in first_line
    assert "config file is broken" in tail
    assert not (state_dir / "run" / "broken.json").exists()


def test_service_that_never_listens_times_out_and_is_stopped(state_dir: Path) -> None:
    port = services.free_port()
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    started = time.monotonic()
    with pytest.raises(services.ServiceTimeout):
        services.start_service("mute", argv, port, state_dir, timeout_s=1.5)
    assert time.monotonic() - started < 20  # a deadline against hangs: > 10x the 1.5 s timeout
    assert not (state_dir / "run" / "mute.json").exists()


def test_busy_port_not_ours_is_port_in_use(state_dir: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(services.PortInUse, match=str(port)):
            services.start_service("web", _http_server_argv(port), port, state_dir)
        with pytest.raises(services.PortInUse):
            s3server.ensure_s3(state_dir, port)


def test_stop_all_stops_only_recorded_services(state_dir: Path, bystander: subprocess.Popen) -> None:
    port = services.free_port()
    services.start_service("web", _http_server_argv(port), port, state_dir, timeout_s=30)
    # A pid file whose pid is alive but belongs to another process (a recycled pid): the
    # recorded kernel start time does not match, so it must be left alone.
    forged = {"name": "ghost", "pid": bystander.pid, "port": 1, "argv": ["x"], "started_at": 0.0,
              "proc_start": 1, "log_path": "/dev/null"}
    (state_dir / "run" / "ghost.json").write_text(json.dumps(forged))

    assert services.stop_all(state_dir) == ["web"]
    assert bystander.poll() is None
    assert list((state_dir / "run").glob("*.json")) == []


# --- S3 -----------------------------------------------------------------------------------


@pytest.mark.s3
def test_moto_s3_roundtrip_and_reuse(state_dir: Path) -> None:
    import boto3

    started = time.monotonic()
    url = s3server.ensure_s3(state_dir)
    start_s = time.monotonic() - started
    pid = services.is_running(s3server.SERVICE_NAME, state_dir).pid
    env = s3server.s3_env(url)
    client = boto3.client(
        "s3",
        endpoint_url=url,
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
    )
    client.create_bucket(Bucket="stoker-test")
    client.put_object(Bucket="stoker-test", Key="models/tiny/1/", Body=b"")
    client.put_object(Bucket="stoker-test", Key="models/tiny/config.pbtxt", Body=b'name: "tiny"')
    keys = [o["Key"] for o in client.list_objects_v2(Bucket="stoker-test")["Contents"]]
    assert keys == ["models/tiny/1/", "models/tiny/config.pbtxt"]
    assert client.get_object(Bucket="stoker-test", Key="models/tiny/config.pbtxt")["Body"].read() == b'name: "tiny"'

    assert s3server.ensure_s3(state_dir) == url
    assert services.is_running(s3server.SERVICE_NAME, state_dir).pid == pid
    print(f"\nmoto_server start: {start_s:.2f} s")


# --- tiny model ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    out = tmp_path_factory.mktemp("tiny") / "model"
    return out, tinymodel.make_tiny_model(out, seed=0)


def test_tiny_model_is_deterministic_and_complete(
    tiny_model: tuple[Path, dict[str, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(tinymodel.CACHE_ENV, raising=False)  # built again, not copied: determinism is the point
    out, files = tiny_model
    assert sorted(files) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert {name: tinymodel.sha256_file(out / name) for name in files} == files
    assert tinymodel.make_tiny_model(tmp_path / "again", seed=0) == files

    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (256, 512, 4)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (8, 2, 2048)
    assert config["tie_word_embeddings"] is False and config["torch_dtype"] == "bfloat16"
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    generation = json.loads((out / "generation_config.json").read_text())
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (
        ids["<s>"], ids["</s>"], ids["<pad>"]
    )
    assert len(tokenizer["model"]["vocab"]) == 2048


def test_tiny_model_other_seed_differs(tiny_model: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    files = tinymodel.make_tiny_model(tmp_path / "seed1", seed=1)
    assert files["model.safetensors"] != tiny_model[1]["model.safetensors"]
    assert files["tokenizer.json"] == tiny_model[1]["tokenizer.json"]


# --- Hub mirror + stoker.storage.hub --------------------------------------------------------------


@dataclass(frozen=True)
class Mirror:
    endpoint: str
    repos: Path
    state: Path
    start_s: float


@pytest.fixture(scope="module")
def mirror(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mirror]:
    """An olah mirror private to this module (repos get distinct names per test)."""
    state = tmp_path_factory.mktemp("mirror-state")
    started = time.monotonic()
    endpoint = hub_mirror.ensure_mirror(state)
    yield Mirror(endpoint, hub_mirror.repos_dir(state), state, time.monotonic() - started)
    log = (state / "logs" / f"{hub_mirror.SERVICE_NAME}.log").read_text()
    services.stop_all(state)
    assert TOKEN not in log


@pytest.mark.hub
def test_mirror_reuse(mirror: Mirror) -> None:
    assert hub_mirror.ensure_mirror(mirror.state) == mirror.endpoint
    print(f"\nolah mirror start: {mirror.start_s:.2f} s")
    # A deadline against hangs (start_service's own limit), not a speed claim: olah starts in a few seconds.
    assert mirror.start_s < 60


@pytest.mark.hub
def test_publish_resolve_fetch_roundtrip(
    mirror: Mirror, tiny_model: tuple[Path, dict[str, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint, repos = mirror.endpoint, mirror.repos
    src, source_files = tiny_model
    sha = hub_mirror.publish_model(repos, "stoker-test/tiny-llama", src, "tiny llama seed 0")
    assert hub.resolve("stoker-test/tiny-llama", "main", endpoint, TOKEN) == sha
    assert hub.resolve("stoker-test/tiny-llama", sha, endpoint) == sha

    messages: list[str] = []
    fed: list[float] = []

    class Counted(progress.Progress):  # what huggingface_hub's bars feed into stoker's progress
        def advance(self, n: float) -> None:
            fed.append(n)
            super().advance(n)

    monkeypatch.setattr(hub, "Progress", Counted)
    dest = tmp_path / "models" / "tiny"
    started = time.monotonic()
    records = hub.fetch("stoker-test/tiny-llama", sha, endpoint, TOKEN, dest, progress=messages.append)
    fetch_s = time.monotonic() - started
    print(f"\nfetch of {sum(r.bytes for r in records) / 1e6:.1f} MB: {fetch_s:.2f} s")

    assert {r.path: r.sha256 for r in records} == source_files
    assert {r.path: r.bytes for r in records} == {n: (src / n).stat().st_size for n in source_files}
    assert sorted(p.name for p in dest.iterdir()) == sorted(source_files)  # no .cache, nothing extra
    assert [p.name for p in dest.parent.iterdir()] == ["tiny"]  # no partial dir left behind
    assert messages and all(TOKEN not in m for m in messages)
    total = sum(r.bytes for r in records)
    assert sum(fed) == total  # the bytes as they arrived, counted by huggingface_hub's own bars
    assert any(m.startswith(f"download: {total / 1e6:.1f}/{total / 1e6:.1f} MB (100%, ") for m in messages)

    with pytest.raises(hub.HubError, match="already exists"):
        hub.fetch("stoker-test/tiny-llama", sha, endpoint, TOKEN, dest)


@pytest.mark.hub
def test_new_commit_is_new_revision_and_old_sha_stays_pinned(
    mirror: Mirror, tiny_model: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    endpoint, repos = mirror.endpoint, mirror.repos
    src, source_files = tiny_model
    first = hub_mirror.publish_model(repos, "stoker-test/evolving", src, "v1")
    assert hub.resolve("stoker-test/evolving", "main", endpoint) == first

    changed = tmp_path / "changed"
    changed.mkdir()
    for name in source_files:
        (changed / name).write_bytes((src / name).read_bytes())
    (changed / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2, "max_new_tokens": 7}\n')
    second = hub_mirror.publish_model(repos, "stoker-test/evolving", changed, "v2")
    assert second != first
    assert hub.resolve("stoker-test/evolving", "main", endpoint) == second

    old = hub.fetch("stoker-test/evolving", first, endpoint, None, tmp_path / "old")
    new = hub.fetch("stoker-test/evolving", second, endpoint, None, tmp_path / "new")
    old_digests = {r.path: r.sha256 for r in old}
    new_digests = {r.path: r.sha256 for r in new}
    assert old_digests == source_files
    assert new_digests["generation_config.json"] != old_digests["generation_config.json"]
    assert new_digests["model.safetensors"] == old_digests["model.safetensors"]


@pytest.mark.hub
def test_unknown_repo_and_revision(mirror: Mirror, tiny_model: tuple[Path, dict[str, str]]) -> None:
    endpoint, repos = mirror.endpoint, mirror.repos
    hub_mirror.publish_model(repos, "stoker-test/known", tiny_model[0], "v1")
    with pytest.raises(hub.RepoNotFound) as missing_repo:
        hub.resolve("stoker-test/does-not-exist", "main", endpoint, TOKEN)
    with pytest.raises(hub.RevisionNotFound) as missing_revision:
        hub.resolve("stoker-test/known", "no-such-branch", endpoint, TOKEN)
    for error in (missing_repo.value, missing_revision.value):
        assert TOKEN not in str(error) and "\n" not in str(error)
    assert "main" in str(missing_revision.value)  # lists the branches that do exist


@pytest.mark.hub
def test_pickle_only_repo_refused_unless_allowed(mirror: Mirror, tmp_path: Path) -> None:
    endpoint, repos = mirror.endpoint, mirror.repos
    src = tmp_path / "pickled"
    src.mkdir()
    (src / "config.json").write_text('{"model_type": "llama"}\n')
    (src / "pytorch_model.bin").write_bytes(os.urandom(4096))
    sha = hub_mirror.publish_model(repos, "stoker-test/pickled", src, "pickles only")

    with pytest.raises(hub.PickleRefused):
        hub.fetch("stoker-test/pickled", sha, endpoint, None, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    records = hub.fetch("stoker-test/pickled", sha, endpoint, None, tmp_path / "allowed", allow_pickle=True)
    assert sorted(r.path for r in records) == ["config.json", "pytorch_model.bin"]


@pytest.mark.hub
def test_readme_only_repo_has_no_safetensors(mirror: Mirror, tmp_path: Path) -> None:
    endpoint, repos = mirror.endpoint, mirror.repos
    src = tmp_path / "readme"
    src.mkdir()
    (src / "README.md").write_text("# Nothing to load here\n")
    sha = hub_mirror.publish_model(repos, "stoker-test/readme-only", src, "docs only")
    assert hub.resolve("stoker-test/readme-only", "main", endpoint) == sha
    with pytest.raises(hub.NoSafetensors):
        hub.fetch("stoker-test/readme-only", sha, endpoint, None, tmp_path / "dest")
    assert not (tmp_path / "dest").exists()
