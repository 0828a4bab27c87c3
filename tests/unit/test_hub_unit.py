"""stoker.storage.hub without a server: file selection and error mapping."""

from __future__ import annotations

from pathlib import Path

import httpx2
import pytest
from huggingface_hub.utils import hf_raise_for_status

from stoker.storage import hub

ENDPOINT = "http://127.0.0.1:9"
TOKEN = "hf_unit_test_secret_token_value"

TOKENIZER = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]


# --- select_files -------------------------------------------------------------------------


def test_select_single_safetensors_with_configs_and_tokenizer() -> None:
    files = [".gitattributes", "README.md", "config.json", "generation_config.json", "model.safetensors", *TOKENIZER]
    assert hub.select_files(files) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", *TOKENIZER]
    )


def test_select_sharded_safetensors_ignores_pickles_and_subfolders() -> None:
    files = [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "pytorch_model.bin",
        "original/consolidated.00.pth",
        "original/tokenizer.model",
        "onnx/model.onnx",
        "tokenizer.model",
        "vocab.json",
        "merges.txt",
    ]
    assert hub.select_files(files) == [
        "config.json",
        "merges.txt",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.model",
        "vocab.json",
    ]


def test_select_skips_duplicate_consolidated_checkpoint() -> None:
    files = ["config.json", "consolidated.safetensors", "model.safetensors", "params.json"]
    assert hub.select_files(files) == ["config.json", "model.safetensors"]


def test_select_takes_consolidated_when_it_is_the_only_weights() -> None:
    assert hub.select_files(["consolidated.safetensors", "params.json"]) == ["consolidated.safetensors"]


def test_pickle_only_repo_is_refused() -> None:
    with pytest.raises(hub.PickleRefused, match="pytorch_model.bin"):
        hub.select_files(["config.json", "pytorch_model.bin", *TOKENIZER])


def test_pickle_only_repo_allowed_explicitly() -> None:
    files = ["config.json", "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin",
             "pytorch_model.bin.index.json", "training_args.bin", "tokenizer.json"]
    assert hub.select_files(files, allow_pickle=True) == [
        "config.json",
        "pytorch_model-00001-of-00002.bin",
        "pytorch_model-00002-of-00002.bin",
        "pytorch_model.bin.index.json",
        "tokenizer.json",
    ]


@pytest.mark.parametrize("files", [["README.md"], [], ["config.json", "training_args.bin"], ["sub/model.safetensors"]])
def test_no_weights_raises_no_safetensors(files: list[str]) -> None:
    with pytest.raises(hub.NoSafetensors):
        hub.select_files(files, allow_pickle=True)


def test_errors_form_one_tree() -> None:
    for cls in (hub.RepoNotFound, hub.RevisionNotFound, hub.NoSafetensors, hub.PickleRefused,
                hub.GatedNeedsToken, hub.HubUnavailable):
        assert issubclass(cls, hub.HubError)


# --- error mapping: real huggingface_hub exceptions built from real HTTP responses ----------


def _hf_error(status: int, error_code: str | None = None) -> Exception:
    headers = {"X-Error-Code": error_code} if error_code else {}
    # https: huggingface_hub reads a bare 401 on an https repo API URL as "repo not found".
    url = "https://hub.example/api/models/org/name/revision/main"
    response = httpx2.Response(status, headers=headers, request=httpx2.Request("GET", url))
    with pytest.raises(Exception) as info:
        hf_raise_for_status(response)
    return info.value


@pytest.mark.parametrize(
    ("status", "code", "expected"),
    [
        (404, "RepoNotFound", hub.RepoNotFound),
        (401, None, hub.RepoNotFound),
        (404, "RevisionNotFound", hub.RevisionNotFound),
        (403, "GatedRepo", hub.GatedNeedsToken),
        (503, None, hub.HubUnavailable),
        (429, None, hub.HubUnavailable),
        (400, None, hub.HubError),
    ],
)
def test_http_errors_map_to_typed_errors(status: int, code: str | None, expected: type[hub.HubError]) -> None:
    mapped = hub.map_error(_hf_error(status, code), "org/name", "main", ENDPOINT, TOKEN)
    assert type(mapped) is expected
    assert "\n" not in str(mapped)
    assert TOKEN not in str(mapped)


def test_connection_error_maps_to_unavailable() -> None:
    exc = httpx2.ConnectError("[Errno 111] Connection refused")
    mapped = hub.map_error(exc, "org/name", "main", ENDPOINT)
    assert isinstance(mapped, hub.HubUnavailable)
    assert ENDPOINT in str(mapped)


def test_token_is_scrubbed_from_unexpected_errors() -> None:
    mapped = hub.map_error(ValueError(f"bad header Bearer {TOKEN}\nmore"), "org/name", "main", ENDPOINT, TOKEN)
    assert type(mapped) is hub.HubError
    assert TOKEN not in str(mapped)
    assert "\n" not in str(mapped)


def test_resolve_requires_revision() -> None:
    with pytest.raises(hub.HubError, match="explicit revision"):
        hub.resolve("org/name", "", ENDPOINT)


def test_resolve_unreachable_endpoint_is_unavailable() -> None:
    # Port 9 (discard) is closed on these machines: a real refused connection.
    with pytest.raises(hub.HubUnavailable):
        hub.resolve("org/name", "main", ENDPOINT, TOKEN)


def test_fetch_refuses_unpinned_revision(tmp_path: Path) -> None:
    with pytest.raises(hub.HubError, match="40-hex"):
        hub.fetch("org/name", "main", ENDPOINT, None, tmp_path / "dest")
    assert not (tmp_path / "dest").exists()
