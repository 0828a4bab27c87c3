"""Reading a spec: YAML or a mapping → a validated Spec, its target and sections checked by the target registry.

The spec itself is pure data and only names its target; the targets (stoker/targets/) decide what they take. This
module hands the registry's lookup to pydantic's validation context, so an unknown target or a section the target
refuses is reported where pydantic reports the rest, in the same one line naming the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from pydantic import ValidationError

from .. import targets
from ..errors import SpecError
from .schema import TARGET_LOOKUP, Spec

if TYPE_CHECKING:
    from ..targets.base import Target

def _one_line(err: ValidationError) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "spec"
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
    elif first["type"] == "missing":
        msg = "required"
    more = f" (+{len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    return f"{loc}: {msg}{more}"


def parse_spec(data: object, source: str = "spec") -> Spec:
    """Validate a mapping into a Spec, raising SpecError with a one-line cause."""
    if not isinstance(data, dict):
        raise SpecError(f"{source}: expected a mapping at the top level")
    try:
        return Spec.model_validate(data, context={TARGET_LOOKUP: targets.get})
    except ValidationError as err:
        raise SpecError(f"{source}: {_one_line(err)}") from None


def target_of(spec: Spec, source: str = "spec") -> Target:
    """The spec's target, after the checks parse_spec makes: for a Spec validated without the registry (a flow's
    parameter, which Prefect validates from JSON)."""
    try:
        target = targets.get(spec.target)
    except ValueError as err:
        raise SpecError(f"{source}: target: {err}") from None
    for field, check, section in (("quantization", target.check_quantization, spec.quantization),
                                  ("gpus", target.check_gpus, spec.gpus)):
        try:
            check(section)
        except ValueError as err:
            raise SpecError(f"{source}: {field}: {err}") from None
    return target


def load_spec(path: str | Path) -> Spec:
    """Read and validate a YAML spec file."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise SpecError(f"{p}: no such file") from None
    except yaml.YAMLError as err:
        raise SpecError(f"{p}: not valid YAML ({str(err).splitlines()[0]})") from None
    spec = parse_spec(data, str(p))
    # Relative paths in a spec are relative to the spec file, not the cwd.
    return _anchor_paths(spec, p.resolve().parent)


def _anchor_paths(spec: Spec, base: Path) -> Spec:
    model, quant, ev = spec.model, spec.quantization, spec.evaluation
    if ev.text_file is not None and not ev.text_file.is_absolute():
        ev = ev.model_copy(update={"text_file": base / ev.text_file})
    if model.local_path is not None and not model.local_path.is_absolute():
        model = model.model_copy(update={"local_path": base / model.local_path})
    cal = quant.calibration
    if cal.text_file is not None and not cal.text_file.is_absolute():
        quant = quant.model_copy(update={"calibration": cal.model_copy(update={"text_file": base / cal.text_file})})
    return spec.model_copy(update={"model": model, "quantization": quant, "evaluation": ev})
