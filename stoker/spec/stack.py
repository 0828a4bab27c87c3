"""The specs one host's stack serves, checked together: no two of them on one port or one deployment name.

Each spec is valid alone, yet two of them deployed side by side fight: the second proxy finds the first one's
port taken after its whole build (issue 22: the webhook's example and the watched spec both on 8100). The
stack's specs are those it can start: every watch in prefect.yaml, every spec in the webhook's folder, and the
demo's. `stoker deploy-flows` and `stoker webhook serve` refuse a clash in one line naming both, before any run.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import yaml

from ..errors import SpecError
from .schema import Spec
from .load import load_spec, parse_spec


class StackClash(SpecError):
    """Two specs of one stack share a port or a deployment name."""


def prefect_yaml_specs(prefect_file: Path) -> dict[str, Spec]:
    """The specs a prefect.yaml's deployments start: each watch's spec, and a default `spec` parameter."""
    data = yaml.safe_load(Path(prefect_file).read_text()) or {}
    found: dict[str, Spec] = {}
    for dep in data.get("deployments") or []:
        params = (dep or {}).get("parameters") or {}
        where = f"{prefect_file} deployment {dep.get('name')!r}"
        if isinstance(params.get("spec"), dict):
            found[f"{where} spec"] = parse_spec(params["spec"], f"{where} spec")
        for i, watch in enumerate(params.get("watches") or []):
            if isinstance(watch, dict) and isinstance(watch.get("spec"), dict):
                found[f"{where} watches[{i}]"] = parse_spec(watch["spec"], f"{where} watches[{i}]")
    return found


def folder_specs(folder: Path) -> dict[str, Spec]:
    """Every NAME.yaml spec of a folder (the webhook's), by path."""
    return {str(p): load_spec(p) for p in sorted(Path(folder).glob("*.yaml"))}


def clashes(specs: dict[str, Spec]) -> list[str]:
    """One line per clash: a port (http, grpc or metrics) or a deploy.name used by two specs, naming both."""
    seen_ports: dict[int, str] = {}
    seen_names: dict[str, str] = {}
    out = []
    for where, spec in specs.items():
        d = spec.deploy
        if d.name in seen_names:
            out.append(f"deploy.name {d.name!r} of {where} is also the name of {seen_names[d.name]}")
        else:
            seen_names[d.name] = where
        for kind, port in (("http", d.ports.http), ("grpc", d.ports.grpc), ("metrics", d.ports.metrics)):
            label = f"{where} (deploy.ports.{kind})"
            if port in seen_ports:
                out.append(f"port {port} of {label} is also used by {seen_ports[port]}")
            else:
                seen_ports[port] = label
    return out


def check(groups: Iterable[dict[str, Spec]]) -> int:
    """Refuse a clash among the union of the groups; returns how many specs were checked."""
    merged: dict[str, Spec] = {}
    for g in groups:
        merged.update(g)
    found = clashes(merged)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise StackClash(f"two specs of this stack clash: {found[0]}{more}")
    return len(merged)
