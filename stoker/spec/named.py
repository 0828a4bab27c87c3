"""A build asked for by name: a spec of a folder the stack trusts, at a revision, as the webhook and the
`stoker.build.requested` event take it. Neither a signed request nor an event carries a spec of its own: what
runs (image, Docker host, addresses, pickled weights) is what the folder's owner wrote."""

from __future__ import annotations

from pathlib import Path

from ..errors import StokerError
from .schema import Spec

# A file name in the folder, never a path: no '/', no '..', no hidden file.
SPEC_NAME = r"^[a-z0-9][a-z0-9_-]{0,62}$"
REVISION = r"^\S{1,200}$"
# The specs folder of this checkout: where the flows run from (prefect.yaml's pull step) and the webhook's default.
SPECS_DIR = Path(__file__).resolve().parents[2] / "deployments" / "specs"


def load_named(folder: Path, name: str, revision: str, repo: str | None = None) -> Spec:
    """``folder``/NAME.yaml at ``revision``; StokerError (one line) for a name that is not one of its specs or a
    repo that is not the spec's."""
    import re

    from .load import load_spec

    if not re.match(SPEC_NAME, name):
        raise StokerError(f"spec {name!r}: not a spec name (lowercase letters, digits, '-', '_')")
    if not re.match(REVISION, revision):
        raise StokerError(f"revision {revision!r}: one word of at most 200 characters")
    path = Path(folder) / f"{name}.yaml"
    if not path.is_file():
        raise StokerError(f"spec {name!r}: no {path.name} in {folder}")
    try:
        spec = load_spec(path)
    except StokerError as err:
        raise StokerError(f"spec {name!r}: {err}") from None
    if repo and spec.model.repo_id != repo:
        raise StokerError(f"repo {repo!r} is not the repo of spec {name!r} ({spec.model.repo_id})")
    return spec.model_copy(update={"model": spec.model.model_copy(update={"revision": revision})})
