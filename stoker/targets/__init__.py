"""The targets stoker builds for: each is one module here behind `stoker.targets.base.Target`.

A target lives in `stoker/targets/<name>.py` and exposes `TARGET`; `get(name)` imports that module
on first use, so a fourth target is one new module and no edit elsewhere. The lookup is lazy because
reading a spec asks the registry (stoker/spec/load.py), and a spec must stay cheap to read (no Prefect, no target
code).
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING

from ..spec.schema import DEFAULT_TARGET

if TYPE_CHECKING:
    from .base import Target

DEFAULT = DEFAULT_TARGET
_SHARED = {"base", "gpu"}  # modules here that hold code the targets share, not a target of their own
_registered: dict[str, Target] = {}


def register(target: Target) -> Target:
    """Make `target` known by its name (targets outside this package, e.g. a test's)."""
    _registered[target.name] = target
    return target


def unregister(name: str) -> None:
    _registered.pop(name, None)


def get(name: str) -> Target:
    """The target called `name`; ValueError naming the known ones otherwise (the spec's message)."""
    if name not in _registered and name in _modules():
        register(importlib.import_module(f"{__name__}.{name}").TARGET)
    if name not in _registered:
        raise ValueError(f"Input should be {_choices(names())}")
    return _registered[name]


def names() -> list[str]:
    """Every known target, the default first."""
    return sorted(set(_registered) | set(_modules()), key=lambda n: (n != DEFAULT, n))


def _modules() -> list[str]:
    return [m.name for m in pkgutil.iter_modules(__path__) if not m.ispkg and m.name not in _SHARED]


def _choices(known: list[str]) -> str:
    quoted = [repr(n) for n in known]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
