"""`stoker rollback --fleet`'s plan (stoker.record.returnable.fleet_plan, pure): each host goes back among its own
runs only, a named fleet run means each host's part of it, a host already serving that build is skipped, and a host
with nowhere to go refuses the whole rollback in one line naming it."""

from __future__ import annotations

import pytest

from stoker.record.returnable import RollbackError, fleet_plan

NAME = "dep"
DONE = {"status": "completed"}


def _host_run(fleet_run: str, host: str, digest: str, switched: bool = True) -> dict:
    steps = {"upload": {**DONE, "digest": digest}, "deploy": DONE, "benchmark": DONE, "gate": DONE}
    if switched:
        steps["switch"] = DONE
    return {"run_id": f"{fleet_run}-{host}", "status": "completed", "steps": steps, "kind": "serve_host",
            "fleet_host": host, "spec": {"deploy": {"name": NAME}, "storage": {"bucket": "bkt"}}}


A, B, C = "20260101T000001-aaaaaa", "20260101T000002-bbbbbb", "20260101T000003-cccccc"
EVERY = [_host_run(A, "east", "da"), _host_run(A, "west", "da"), _host_run(B, "east", "db"),
         _host_run(B, "west", "db"),
         # C reached east only (the fleet halted in wave 2): east's own history is A, B, C
         _host_run(C, "east", "dc")]


def test_each_host_goes_back_among_its_own_runs():
    plan = fleet_plan(EVERY, NAME, {"east": "dc", "west": "db"}, None)
    assert plan["east"] == {"before": "dc", "to_run": f"{B}-east", "to": "db", "skip": False}
    assert plan["west"] == {"before": "db", "to_run": f"{A}-west", "to": "da", "skip": False}


def test_a_named_fleet_run_is_each_hosts_part_of_it_and_a_host_on_it_already_is_skipped():
    plan = fleet_plan(EVERY, NAME, {"east": "dc", "west": "da"}, A)
    assert plan["east"]["to_run"] == f"{A}-east" and not plan["east"]["skip"]
    assert plan["west"] == {"before": "da", "to_run": f"{A}-west", "to": "da", "skip": True}


def test_a_host_with_nowhere_to_go_refuses_the_whole_rollback_naming_it():
    with pytest.raises(RollbackError) as err:
        fleet_plan(EVERY, NAME, {"east": "db", "west": "db"}, C)  # C never reached west
    assert str(err.value).startswith("fleet rollback: host 'west': run ") and "nothing changed" in str(err.value)
    with pytest.raises(RollbackError, match="host 'west' serves nothing: name the fleet run"):
        fleet_plan(EVERY, NAME, {"east": "db", "west": None}, None)
    with pytest.raises(RollbackError, match="host 'east': nothing older to roll back to"):
        fleet_plan(EVERY, NAME, {"east": "da", "west": "db"}, None)


def test_a_run_of_another_host_or_one_that_never_switched_is_no_way_back():
    unswitched = _host_run("20260101T000004-dddddd", "east", "dd", switched=False)
    plan = fleet_plan([*EVERY, unswitched], NAME, {"east": "dc", "west": "db"}, None)
    assert plan["east"]["to_run"] == f"{B}-east"
    with pytest.raises(RollbackError, match="host 'east'"):
        fleet_plan([*EVERY, unswitched], NAME, {"east": "dc", "west": "db"}, "20260101T000004-dddddd")


def test_the_command_refuses_in_one_line_before_it_reaches_prefect(tmp_path, monkeypatch, capsys):
    import json

    from stoker.cli import main

    fleet = {"model": {"repo_id": "org/model"}, "deploy": {"name": NAME},
             "storage": {"bucket": "my-bucket", "shared_cache": True},
             "fleet": {"hosts": [{"name": "east", "docker_host": "unix:///run/east.sock",
                                  "deployment": "serve_host/east"}]}}
    plain = {k: v for k, v in fleet.items() if k != "fleet"}
    for name, data in (("fleet.yaml", fleet), ("plain.yaml", plain)):
        (tmp_path / name).write_text(json.dumps(data))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    cases = [([NAME, "--fleet", str(tmp_path / "fleet.yaml")], "--fleet needs PREFECT_API_URL"),
             ([NAME, "--fleet", str(tmp_path / "fleet.yaml"), "--spec", str(tmp_path / "plain.yaml")],
              "give --spec or --fleet, not both")]
    for args, says in cases:
        assert main(["rollback", *args]) == 1
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # never reached: refused before
    for args, says in [([NAME, "--fleet", str(tmp_path / "plain.yaml")], "no fleet section"),
                       (["other", "--fleet", str(tmp_path / "fleet.yaml")], f"deploys {NAME!r}, not 'other'")]:
        assert main(["rollback", *args]) == 1
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err
