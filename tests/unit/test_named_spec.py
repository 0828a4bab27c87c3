"""A build asked for by name (the webhook and the stoker.build.requested event): only a spec of the folder, pinned to
the revision asked, and one line for anything else."""

from __future__ import annotations

import pytest

from stoker.errors import StokerError
from stoker.spec.named import SPECS_DIR, load_named


def test_a_spec_of_the_folder_is_pinned_to_the_revision_asked():
    spec = load_named(SPECS_DIR, "example-full", "abc123")
    assert spec.model.revision == "abc123" and spec.model.repo_id == "stoker/tiny-llama"
    assert load_named(SPECS_DIR, "example-full", "v1", "stoker/tiny-llama").model.revision == "v1"


@pytest.mark.parametrize("name, revision, repo, message", [
    ("../example-full", "main", None, "not a spec name"),
    ("Example-Full", "main", None, "not a spec name"),
    ("nope", "main", None, "spec 'nope': no nope.yaml in"),
    ("example-full", "two words", None, "revision 'two words': one word"),
    ("example-full", "main", "evil/model", "repo 'evil/model' is not the repo of spec 'example-full'"),
])
def test_anything_else_is_one_line(name, revision, repo, message):
    with pytest.raises(StokerError) as err:
        load_named(SPECS_DIR, name, revision, repo)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_spec_the_schema_refuses_is_named_in_the_line(tmp_path):
    (tmp_path / "bad.yaml").write_text("model: {repo_id: a/b}\n")
    with pytest.raises(StokerError, match=r"^spec 'bad': .*storage: required"):
        load_named(tmp_path, "bad", "main")
