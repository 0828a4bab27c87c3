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


GPU_TARGETS = ("tensorrt", "pytorch")


def gpu_specs(*targets: str) -> list[Path]:
    """The example specs whose target is one of `targets` (default: every GPU target)."""
    import yaml

    targets = targets or GPU_TARGETS
    return sorted(p for p in SPECS.glob("*.yaml") if yaml.safe_load(p.read_text()).get("target") in targets)


def pytest_configure(config):
    config.addinivalue_line("markers", "targets(*names): the GPU targets a `rendered` contract test applies to")


def pytest_generate_tests(metafunc):
    """`rendered` is parametrized only over the specs a test applies to (@pytest.mark.targets), so no case passes
    without checking anything."""
    if "rendered" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("targets")
        targets = marker.args if marker else GPU_TARGETS
        assert set(targets) <= set(GPU_TARGETS), targets
        specs = gpu_specs(*targets)
        assert specs, f"no example spec has target {targets}: {metafunc.definition.nodeid} would check nothing"
        metafunc.parametrize("rendered", specs, indirect=True, ids=[p.stem for p in specs])


@pytest.fixture
def rendered(request, tmp_path, monkeypatch) -> dict:
    """`stoker render` of one example spec: commands.json + the repository folder."""
    from stoker.commands.render import render

    monkeypatch.setenv("HF_TOKEN", "hf_contract_placeholder")  # the Llama 3 repos are gated
    doc = render(request.param, tmp_path / "out")
    marker = request.node.get_closest_marker("targets")
    assert doc["target"] in (marker.args if marker else GPU_TARGETS), (doc["target"], request.param.name)
    return {"doc": doc, "repo": tmp_path / "out" / "model_repository", "spec": request.param}
