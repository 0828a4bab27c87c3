"""Contract fixtures: the vendored upstream extracts (see upstream/README.md) and rendered example specs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

UPSTREAM = Path(__file__).resolve().parent / "upstream"
SPECS = Path(__file__).resolve().parents[2] / "deployments" / "specs"


def _sections(path: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
            out[current] = []
        elif current is not None:
            out[current].append(line)
    return out


@pytest.fixture(scope="session")
def build_flags() -> dict[str, set[str]]:
    """accepted / deprecated / unsupported option strings of trtllm-build 1.2."""
    accepted, deprecated, unsupported, section = set(), set(), set(), "main"
    for raw in (UPSTREAM / "trtllm_build_flags.txt").read_text().splitlines():
        line = raw.strip()
        if line.startswith("# deprecated"):
            section = "deprecated"
        elif line.startswith("# accepted-but-unsupported"):
            section = "unsupported"
        elif line.startswith("--"):
            {"main": accepted, "deprecated": deprecated, "unsupported": unsupported}[section].add(line)
    return {"accepted": accepted, "deprecated": deprecated, "unsupported": unsupported}


@pytest.fixture(scope="session")
def qformats() -> dict[str, list[str]]:
    return _sections(UPSTREAM / "quantize_qformats.txt")


@pytest.fixture(scope="session")
def ibl() -> dict:
    return json.loads((UPSTREAM / "inflight_batcher_llm_params.json").read_text())


@pytest.fixture(scope="session")
def llmapi_layout() -> dict:
    return json.loads((UPSTREAM / "llmapi_layout.json").read_text())


def gpu_specs() -> list[Path]:
    import yaml

    return sorted(p for p in SPECS.glob("*.yaml") if yaml.safe_load(p.read_text()).get("target") in ("tensorrt", "pytorch"))


@pytest.fixture(params=gpu_specs(), ids=lambda p: p.stem)
def rendered(request, tmp_path, monkeypatch) -> dict:
    """`stoker render` of one example spec: commands.json + the repository folder."""
    from stoker.commands.render import render

    monkeypatch.setenv("HF_TOKEN", "hf_contract_placeholder")  # the Llama 3 repos are gated
    doc = render(request.param, tmp_path / "out")
    return {"doc": doc, "repo": tmp_path / "out" / "model_repository", "spec": request.param}
