"""What every section of the spec shares: closed to unknown keys, frozen, and the helpers their validators use.

Pure data, imported by stoker.spec.schema and the modules that hold its larger sections (stoker.spec.quality).
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict

REPO_ID_PATTERN = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _repo_id(v: str) -> str:
    if not REPO_ID_PATTERN.match(v):
        raise ValueError(f"{v!r} is not an 'org/name' repo id")
    return v


RepoId = Annotated[str, AfterValidator(_repo_id)]  # a Hub repo id, model or dataset


def _without_defaults(section: BaseModel, out: object, names: tuple[str, ...]) -> object:
    """``out`` (a section's dump) without the named fields that are at their defaults: fields added later stay out
    of dumps until set, so manifests and spec digests of earlier runs still compare equal."""
    if isinstance(out, dict):
        for name in names:
            if getattr(section, name) == type(section).model_fields[name].default:
                out.pop(name, None)
    return out


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
