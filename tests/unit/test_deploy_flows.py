"""stoker deploy-flows' file handling, without a server: prefect.yaml's deployments, platform.yaml, and the
one-line cause read from `prefect deploy`'s wrapped output."""

from __future__ import annotations

from pathlib import Path

import pytest

from stoker.commands.deploy_flows import DeployFlowsError, deployment_names, last_paragraph, load_platform

ROOT = Path(__file__).resolve().parents[2]


def test_repo_files_declare_every_deployment_the_pool_the_gpu_limit_and_the_automation():
    assert deployment_names(ROOT / "prefect.yaml") == ["stoker-cpu", "event", "matrix", "gpu", "watch"]
    platform = load_platform(ROOT / "deployments/platform.yaml")
    assert [(p.name, p.type) for p in platform.work_pools] == [("stoker-cpu", "process"), ("stoker-gpu", "docker")]
    assert [(lim.name, lim.limit) for lim in platform.concurrency_limits] == [("gpu-0", 1)]
    assert all((ROOT / "deployments" / a).exists() for a in platform.automations)


@pytest.mark.parametrize("doc, message", [
    ("deployments: []\n", "f.yaml: no deployments"),
    ("deployments:\n  - entrypoint: flows/x.py:f\n    work_pool: {name: p}\n", "f.yaml: deployments.0.name: required"),
    ("deployments:\n  - name: a\n    entrypoint: flows/x.py:f\n", "f.yaml: deployments.0.work_pool.name: required"),
    ("deployments: [\n", "f.yaml: not valid YAML"),
])
def test_what_prefect_deploy_would_skip_silently_is_refused_in_one_line(tmp_path, monkeypatch, doc, message):
    monkeypatch.chdir(tmp_path)
    Path("f.yaml").write_text(doc)
    with pytest.raises(DeployFlowsError) as err:
        deployment_names(Path("f.yaml"))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_platform_file_refuses_unknown_keys(tmp_path):
    (tmp_path / "p.yaml").write_text("work_pools: [{name: a, kind: process}]\n")
    with pytest.raises(DeployFlowsError, match=r"p.yaml: work_pools.0.kind: Extra inputs are not permitted"):
        load_platform(tmp_path / "p.yaml")


def test_the_cause_is_prefects_last_message_unwrapped():
    out = ("Deploying x\n\nThis deployment configuration references work pool 'nope' which does not exist. This\n"
           "means no worker will be able to pick up its runs.\n")
    assert last_paragraph(out) == ("This deployment configuration references work pool 'nope' which does not exist. "
                                   "This means no worker will be able to pick up its runs.")
