"""Strict offline validation of rendered objects: no API server is reachable from stoker's machines, so each object
is checked against the API's published schemas, unknown fields refused.

Built-in kinds: kubernetes-validate's bundled JSON schemas (its -strict variants refuse unknown fields), for every
Kubernetes version in VERSIONS. HTTPRoute (a CRD the built-in schemas lack: kubernetes-validate only warns about it):
the Gateway API CRD's own openAPIV3Schema, vendored in schemas/ with its release, made strict the same way (an object
with listed properties admits no others). Neither checks the CRD's CEL rules (x-kubernetes-validations) nor what only
a cluster knows (that a Secret, Gateway or node with GPUs exists).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

# The oldest and newest Kubernetes minor versions stoker's objects are checked against (kubernetes-validate 1.37.0
# bundles 1.25 … 1.37; autoscaling/v2 and policy/v1 are GA in all of them).
VERSIONS = ("1.30", "1.37")
GATEWAY_API = "v1.6.1"
_HTTPROUTE_SCHEMA = Path(__file__).parent / "schemas" / f"httproute-v1-gateway-api-{GATEWAY_API}.json"


class Invalid(ValueError):
    """An object the schema refuses; the message names the object, the version and the path."""


def _strict(schema):
    """additionalProperties: false on every object schema that lists properties and allows nothing else explicitly."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and \
            not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@functools.cache
def _httproute_validator():
    import jsonschema

    schema = _strict(json.loads(_HTTPROUTE_SCHEMA.read_text()))
    return jsonschema.Draft7Validator(schema)


def _name(obj: dict) -> str:
    return f"{obj.get('kind')} {obj.get('metadata', {}).get('name')}"


def validate(obj: dict, versions: tuple[str, ...] = VERSIONS) -> list[str]:
    """What ``obj`` was validated against (one entry per schema); Invalid (one line) when a schema refuses it."""
    if obj.get("apiVersion") == "gateway.networking.k8s.io/v1" and obj.get("kind") == "HTTPRoute":
        error = next(iter(sorted(_httproute_validator().iter_errors(obj), key=lambda e: list(e.path))), None)
        if error is not None:
            raise Invalid(f"{_name(obj)}: Gateway API {GATEWAY_API}: {'/'.join(map(str, error.path))}: "
                          f"{error.message}")
        return [f"gateway-api {GATEWAY_API}"]
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
