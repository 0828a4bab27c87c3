"""`stoker keys` and the run-order rule, their pure parts: editing a key source without losing its comments, naming a
key by its digest, the one-line refusals that never show a key, and which run may replace which.

On a real proxy (a revoked key refused within seconds, no restart): tests/integration/test_day2_commands.py.
"""

from __future__ import annotations

import json
import re

import pytest
import yaml

from stoker.cli import main
from stoker.record import ordering
from stoker.serving import api_keys
from stoker.spec.schema import ApiKeys

KEY_A, KEY_B = "k-" + "a" * 30, "k-" + "b" * 30


def test_a_generated_key_is_one_the_proxy_checks_and_never_repeats():
    keys = {api_keys.generate() for _ in range(50)}
    assert len(keys) == 50
    for k in keys:
        api_keys.check_key(k)
        assert api_keys.parse(k, "t").digests == (api_keys.digest(k),)


def test_add_and_remove_keep_the_files_comments_and_a_json_list_stays_one():
    text = f"# rotation: B is new\n{KEY_A}\n\n{KEY_B}"
    added = api_keys.with_key(text, "k-" + "c" * 30)
    assert added == f"{text}\nk-{'c' * 30}\n" and api_keys.keys_of(added) == [KEY_A, KEY_B, "k-" + "c" * 30]
    assert api_keys.without(added, {KEY_A}) == f"# rotation: B is new\n\n{KEY_B}\nk-{'c' * 30}\n"
    assert api_keys.with_key("", KEY_A) == f"{KEY_A}\n"
    listed = json.dumps([KEY_A])
    assert json.loads(api_keys.with_key(listed, KEY_B)) == [KEY_A, KEY_B]
    assert json.loads(api_keys.without(json.dumps([KEY_A, KEY_B]), {KEY_B})) == [KEY_A]


def test_a_key_is_named_by_itself_or_by_a_digest_prefix_and_a_wrong_name_says_so_without_a_key():
    keys = [KEY_A, KEY_B]
    assert api_keys.select(keys, KEY_B) == {KEY_B}
    assert api_keys.select(keys, api_keys.digest(KEY_A)[:12].upper()) == {KEY_A}
    for which, says in (("abc", "8+ hex characters"), (KEY_A[:-1], "8+ hex characters"),
                        ("deadbeefdead", "no key whose digest starts with deadbeefdead")):
        with pytest.raises(api_keys.ApiKeysError, match=re.escape(says)) as exc:
            api_keys.select(keys, which)
        assert KEY_A not in str(exc.value) and KEY_B not in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(api_keys.ApiKeysError) as exc:
        api_keys.check_key("has a space in it, sixteen+")
    assert "space" not in str(exc.value)


def test_the_keys_file_is_replaced_atomically_mode_0600(tmp_path):
    f = tmp_path / "keys.txt"
    f.write_text(f"{KEY_A}\n")
    f.chmod(0o644)
    source = ApiKeys(file=f)
    api_keys.write_source(source, api_keys.with_key(api_keys.read_source(source), KEY_B))
    assert api_keys.keys_of(f.read_text()) == [KEY_A, KEY_B] and f.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["keys.txt"]  # no temp file left beside it
    assert api_keys.read_source(ApiKeys(file=tmp_path / "not-yet")) == ""  # `add` makes it


def test_the_command_finds_the_digests_where_the_deployment_puts_them():
    from stoker.commands import keys
    from stoker.serving.deployment import keys_file

    assert keys.keys_file() == keys_file()


def test_a_spec_without_keys_or_a_missing_spec_is_one_line(tmp_path, capsys):
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"model": {"repo_id": "org/model"}, "storage": {"bucket": "bkt"},
                                    "deploy": {"name": "nokeys"}}))
    assert main(["keys", str(spec), "list"]) == 1
    assert capsys.readouterr().err == ("stoker: error: deployment nokeys's spec asks no API key (deploy.api_keys): "
                                       "no keys to list\n")
    assert main(["reconcile", "no-such-deployment"]) == 1
    err = capsys.readouterr().err
    assert "neither a spec file nor a deployment with a run" in err and err.count("\n") == 1


@pytest.mark.parametrize("run_id, serving, force, refused", [
    ("20261128T055900-bbbbbb", "20261128T060000-aaaaaa", False, True),   # older than what serves
    ("20261128T055900-bbbbbb", "20261128T060000-aaaaaa", True, False),   # forced
    ("20261128T060100-cccccc", "20261128T060000-aaaaaa", False, False),  # newer
    ("20261128T060000-cccccc", "20261128T060000-aaaaaa", False, False),  # the same second: not ordered
    ("20261128T055900-bbbbbb", "20261128T055900-bbbbbb", False, False),  # its own backend (a reused candidate)
    ("20261128T055900-bbbbbb", None, False, False),                      # nothing serves
    ("20261128T055900-bbbbbb", "run-a", False, False),                   # not a stoker run id: no order known
    ("20261128T055900-bbbbbb", "20261128T060000-aaaaaa", "same", False),  # its build is what serves: nothing replaced
])
def test_an_older_run_never_replaces_the_build_of_a_newer_one_unless_forced(run_id, serving, force, refused):
    digest = "f" * 64 if force == "same" else "e" * 64
    line = ordering.refusal("dep", run_id, serving, "f" * 64, force is True, digest)
    assert (line is not None) == refused
    if refused:
        assert line == (f"run {run_id} started before run {serving}, whose build ffffffffffff serves dep: an older run "
                        "does not replace a newer one; pass force (stoker run --force) to deploy it anyway")


def test_a_deployment_name_stands_for_the_spec_of_its_newest_run_here(tmp_path, monkeypatch):
    from stoker.commands.reconcile import spec_of

    monkeypatch.setenv("STOKER_HOME", str(tmp_path))
    for run_id, keys_file in (("20261128T050000-aaaaaa", "/old/keys"), ("20261128T060000-bbbbbb", "/new/keys"),
                              ("20261128T070000-cccccc", None)):
        deploy = {"name": "dep" if keys_file else "other", **({"api_keys": {"file": keys_file}} if keys_file else {})}
        (tmp_path / "runs" / run_id).mkdir(parents=True)
        (tmp_path / "runs" / run_id / "manifest.json").write_text(json.dumps(
            {"run_id": run_id, "spec": {"model": {"repo_id": "org/model"}, "storage": {"bucket": "bkt"},
                                        "deploy": deploy}}))
    assert str(spec_of("dep").deploy.api_keys.file) == "/new/keys"
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(yaml.safe_dump({"model": {"repo_id": "org/model"}, "storage": {"bucket": "bkt"},
                                         "deploy": {"name": "dep"}}))
    assert spec_of(str(spec_file)).deploy.api_keys is None  # a file is the spec itself
