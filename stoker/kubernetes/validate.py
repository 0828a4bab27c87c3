"""Strict offline validation of rendered objects: no API server is reachable from stoker's machines, so each object
is checked against the API's published schemas, unknown fields refused.

Built-in kinds: kubernetes-validate's bundled JSON schemas (its -strict variants refuse unknown fields), for every
Kubernetes version in VERSIONS. HTTPRoute (a CRD the built-in schemas lack: kubernetes-validate only warns about it):
first stoker's own list of the fields it renders (anything else refused: the Gateway API's schema admits unknown
fields, so a typo would pass it), then the validator of the npm package @kubernetes-models/gateway-api, generated
from the Gateway API release GATEWAY_API (types, required fields, limits, patterns), run by
infra/kubernetes/validate-httproute.mjs once for all of a render's routes. Neither checks the CRD's CEL rules
(x-kubernetes-validations) nor what only a cluster knows (that a Secret, Gateway or node with GPUs exists).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

# The oldest and newest Kubernetes minor versions stoker's objects are checked against (kubernetes-validate 1.37.0
# bundles 1.25 … 1.37; autoscaling/v2 and policy/v1 are GA in all of them).
VERSIONS = ("1.30", "1.37")
# The npm package pinned in infra/kubernetes/package.json was generated from this Gateway API release (its 2.0.0
# changelog entry and its go.mod: sigs.k8s.io/gateway-api v1.5.1).
GATEWAY_API = "v1.5.1"
PACKAGE = "@kubernetes-models/gateway-api"
NODE_DIR = Path(__file__).resolve().parents[2] / "infra" / "kubernetes"
_SCRIPT = NODE_DIR / "validate-httproute.mjs"
_ROUTE = ("gateway.networking.k8s.io/v1", "HTTPRoute")

# Every HTTPRoute field objects.http_route writes, named as in the Gateway API reference
# (https://gateway-api.sigs.k8s.io/reference/spec/: HTTPRoute, HTTPRouteSpec, ParentReference, HTTPRouteRule,
# HTTPBackendRef). A dict admits only its keys, a one-item list is a list of that, None is any value (the package's
# validator checks types and limits). A field the renderer starts writing is added here, on purpose.
_ROUTE_FIELDS = {
    "apiVersion": None, "kind": None,
    "metadata": {"name": None, "namespace": None, "labels": None},
    "spec": {"parentRefs": [{"name": None}],
             "rules": [{"backendRefs": [{"name": None, "port": None, "weight": None}]}]},
}


class Invalid(ValueError):
    """An object the schema refuses; the message names the object, the version and the path."""


class NotInstalled(RuntimeError):
    """The HTTPRoute validator's packages are missing or not the pinned version; the message says what to run."""


def _is_route(obj: dict) -> bool:
    return (obj.get("apiVersion"), obj.get("kind")) == _ROUTE


def _name(obj: dict) -> str:
    return f"{obj.get('kind')} {obj.get('metadata', {}).get('name')}"


def _unknown(value, allowed, path: str = "") -> str | None:
    """The path of the first field of ``value`` that ``allowed`` does not list, or None."""
    if isinstance(allowed, list) and isinstance(value, list):
        return next((p for i, v in enumerate(value) if (p := _unknown(v, allowed[0], f"{path}/{i}"))), None)
    if isinstance(allowed, dict) and isinstance(value, dict):
        for key, v in value.items():
            if key not in allowed:
                return f"{path}/{key}"
            if p := _unknown(v, allowed[key], f"{path}/{key}"):
                return p
    return None


def _check_installed() -> None:
    setup = "run `make venv-dev` (it installs infra/kubernetes/package-lock.json)"
    if shutil.which("node") is None:
        raise NotInstalled(f"HTTPRoute validation needs node: {setup}")
    wanted = json.loads((NODE_DIR / "package.json").read_text())["dependencies"][PACKAGE]
    installed = NODE_DIR / "node_modules" / PACKAGE / "package.json"
    have = json.loads(installed.read_text())["version"] if installed.exists() else "absent"
    if have != wanted:
        raise NotInstalled(f"HTTPRoute validation needs {PACKAGE} {wanted} in {NODE_DIR}/node_modules "
                           f"(found: {have}): {setup}")


def _validate_routes(routes: list[dict]) -> list[list[str]]:
    """The package validator's errors per route, from one node process for all of them."""
    _check_installed()
    done = subprocess.run(["node", str(_SCRIPT)], input=json.dumps(routes), capture_output=True, text=True,
                          cwd=NODE_DIR, check=False)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{_SCRIPT.name} exited {done.returncode}: {last}")
    return json.loads(done.stdout)


def _validate_builtin(obj: dict, versions: tuple[str, ...]) -> list[str]:
    import kubernetes_validate

    done = []
    for version in versions:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            raise Invalid(f"{_name(obj)}: Kubernetes {version}: {'/'.join(map(str, err.path))}: "
                          f"{err.message}") from None
        except kubernetes_validate.SchemaNotFoundError as err:
            raise Invalid(f"{_name(obj)}: {err.message}") from None
        done.append(f"kubernetes {version}")
    return done


def check_all(objs: list[dict], versions: tuple[str, ...] = VERSIONS) -> list[list[str] | Invalid]:
    """Per object, what it was validated against (one entry per schema), or the Invalid that refused it."""
    routes = [i for i, o in enumerate(objs) if _is_route(o)]
    out: list[list[str] | Invalid] = [[] for _ in objs]
    for i in routes:
        if path := _unknown(objs[i], _ROUTE_FIELDS):
            out[i] = Invalid(f"{_name(objs[i])}: {path}: a field stoker does not render (stoker's HTTPRoute fields)")
    pending = [i for i in routes if not isinstance(out[i], Invalid)]
    for i, errors in zip(pending, _validate_routes([objs[i] for i in pending]) if pending else []):
        out[i] = Invalid(f"{_name(objs[i])}: Gateway API {GATEWAY_API}: {errors[0]}") if errors else \
            ["stoker's HTTPRoute fields", f"gateway-api {GATEWAY_API}"]
    for i, obj in enumerate(objs):
        if not _is_route(obj):
            try:
                out[i] = _validate_builtin(obj, versions)
            except Invalid as err:
                out[i] = err
    return out


def validate_all(objs: list[dict], versions: tuple[str, ...] = VERSIONS) -> list[list[str]]:
    """What each object was validated against; the first Invalid (one line) when a schema refuses one."""
    results = check_all(objs, versions)
    for result in results:
        if isinstance(result, Invalid):
            raise result
    return results


def validate(obj: dict, versions: tuple[str, ...] = VERSIONS) -> list[str]:
    """validate_all for one object (an HTTPRoute costs a node process: validate a render's objects together)."""
    return validate_all([obj], versions)[0]
