"""The specs one stack serves, side by side: the shipped ones never clash; a clash is one line naming both."""

from __future__ import annotations

from pathlib import Path

import pytest

from stoker.spec import stack as stack_specs
from stoker.commands.deploy_flows import check_stack_specs
from stoker.spec.load import parse_spec

ROOT = Path(__file__).resolve().parents[2]


def _spec(name: str, http: int) -> object:
    return parse_spec({"model": {"repo_id": "org/m"}, "storage": {"bucket": "bkt"},
                       "deploy": {"name": name, "ports": {"http": http, "grpc": http + 1, "metrics": http + 2}}})


def test_shipped_specs_of_the_stack_share_no_port_or_name():
    # prefect.yaml's watched spec, every spec of deployments/specs (the webhook's folder) and the demo's.
    assert check_stack_specs(ROOT / "prefect.yaml", ROOT / "deployments" / "specs") >= 9


def test_a_shared_port_is_refused_in_one_line_naming_both():
    found = stack_specs.clashes({"a.yaml": _spec("a", 8100), "b.yaml": _spec("b", 8101)})
    assert found[0] == "port 8101 of b.yaml (deploy.ports.http) is also used by a.yaml (deploy.ports.grpc)"
    with pytest.raises(stack_specs.StackClash) as exc:
        stack_specs.check([{"a.yaml": _spec("a", 8100)}, {"b.yaml": _spec("b", 8101)}])
    msg = str(exc.value)
    assert "\n" not in msg and "a.yaml" in msg and "b.yaml" in msg and "(and 1 more)" in msg


def test_a_shared_deployment_name_is_refused():
    found = stack_specs.clashes({"a.yaml": _spec("same", 8100), "b.yaml": _spec("same", 8200)})
    assert found == ["deploy.name 'same' of b.yaml is also the name of a.yaml"]


def test_prefect_yaml_watches_are_read(tmp_path):
    f = tmp_path / "prefect.yaml"
    f.write_text("deployments:\n  - name: watch\n    entrypoint: x.py:f\n    parameters:\n      watches:\n"
                 "        - spec: {model: {repo_id: org/m}, storage: {bucket: bkt}, deploy: {name: w}}\n")
    assert list(stack_specs.prefect_yaml_specs(f)) == [f"{f} deployment 'watch' watches[0]"]
