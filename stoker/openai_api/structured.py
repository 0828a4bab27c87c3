"""Structured outputs: OpenAI's ``response_format`` ⇄ TensorRT-LLM's guided-decoding inputs. Pure.

    OpenAI                                          Triton (`tensorrt_llm`; BYTES [1, 1] each)
    response_format {"type": "text"} / absent        nothing
    {"type": "json_object"}                          guided_decoding_guide_type "json_schema",
                                                     guided_decoding_guide '{"type":"object"}'
    {"type": "json_schema", "json_schema":           guided_decoding_guide_type "json_schema",
       {"name", "schema", "strict", "description"}}  guided_decoding_guide: the schema as compact JSON

One contract for both targets that have these inputs: the reference runtime enforces it with xgrammar
(stoker/runtime/guided.py); TensorRT-LLM's engine backend does with its own xgrammar, when its `tensorrt_llm` model
is configured for it (see docs/openai.md: by contract, unverified here). `json_object` goes as the schema
``{"type": "object"}`` rather than TensorRT-LLM's `json` guide type, because xgrammar's built-in JSON grammar (what
`json` compiles to) also admits a top-level array, and OpenAI's json_object promises an object. ``strict`` is
accepted either way and changes nothing: the output is always constrained, and properties the schema does not name
are never generated (xgrammar's strict mode, what TensorRT-LLM uses too); OpenAI's stricter schema rules for
``strict: true`` (every property required, additionalProperties false) are not imposed.

Checked here, before anything reaches the backend (a 400 in OpenAI's shape naming the field): the shape and types
of ``response_format``, the schema being a JSON object, every ``$ref`` a local pointer that resolves, and no ``$ref``
chain that leads back to itself (a schema no output can match). A schema that passes these but that the grammar
library cannot compile is refused by the backend before it queues the request; ``refusal`` turns that error into
the same 400. The LLM-API target (TensorRT-LLM 1.2.1's `llmapi` Triton model) declares no guide input, so there
``response_format`` other than text is refused.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from .mapping import ApiError, bad_request

# The `tensorrt_llm` model's input names (TensorRT-LLM's; stoker/runtime/guided.py reads the same two). Not imported
# from there: this package runs where the runtime is not installed.
GUIDE_TYPE_INPUT = "guided_decoding_guide_type"
GUIDE_INPUT = "guided_decoding_guide"
FORMATS = ("text", "json_object", "json_schema")
# OpenAI's rule for json_schema.name.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
JSON_OBJECT_SCHEMA = {"type": "object"}


@dataclass(frozen=True)
class Guide:
    """What `tensorrt_llm` is sent: a guide type and its text; ``param``: the request field it came from."""

    type: str
    text: str
    param: str = "response_format"

    def tensors(self) -> list[tuple[str, bytes]]:
        """(input name, raw BYTES contents of one element): a 4-byte little-endian length, then UTF-8."""
        return [(name, len(raw).to_bytes(4, "little") + raw)
                for name, raw in ((GUIDE_TYPE_INPUT, self.type.encode()), (GUIDE_INPUT, self.text.encode()))]


def _compact(schema: dict) -> str:
    # Key order is kept: it is the order the properties are generated in. Same schema, same text: one compile.
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def guide_for(obj: dict, llmapi: bool = False) -> Guide | None:
    """The guide the request body's ``response_format`` asks for; None for text. ``llmapi``: the backend is the
    LLM API's model, which cannot take a guide."""
    raw = obj.get("response_format")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise bad_request("Invalid type for 'response_format': expected an object.", "response_format", "invalid_type")
    kind = raw.get("type")
    if kind is None:
        raise bad_request("Missing required parameter: 'response_format.type'.", "response_format.type",
                          "missing_required_parameter")
    if kind not in FORMATS:
        raise bad_request(f"Invalid value for 'response_format.type': {kind!r}. Supported values are: "
                          + ", ".join(f"'{f}'" for f in FORMATS) + ".", "response_format.type")
    if kind == "text":
        return None
    if llmapi:
        raise bad_request(f"'response_format' of type '{kind}' is not supported by this deployment: it serves "
                          "TensorRT-LLM's LLM-API model (target: pytorch), whose Triton model (TensorRT-LLM 1.2.1) has "
                          "no per-request guide input.", "response_format", "unsupported_parameter")
    if kind == "json_object":
        return Guide("json_schema", _compact(JSON_OBJECT_SCHEMA))
    spec = raw.get("json_schema")
    where = "response_format.json_schema"
    if spec is None:
        raise bad_request(f"Missing required parameter: '{where}'.", where, "missing_required_parameter")
    if not isinstance(spec, dict):
        raise bad_request(f"Invalid type for '{where}': expected an object.", where, "invalid_type")
    name = spec.get("name")
    if name is None:
        raise bad_request(f"Missing required parameter: '{where}.name'.", f"{where}.name", "missing_required_parameter")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request(f"Invalid value for '{where}.name': it must be 1 to 64 letters, digits, underscores or "
                          "dashes.", f"{where}.name")
    for field, types, label in (("strict", (bool,), "a boolean"), ("description", (str,), "a string")):
        if spec.get(field) is not None and not isinstance(spec[field], types):
            raise bad_request(f"Invalid type for '{where}.{field}': expected {label}.", f"{where}.{field}",
                              "invalid_type")
    schema = spec.get("schema", JSON_OBJECT_SCHEMA)
    if not isinstance(schema, dict):
        raise bad_request(f"Invalid type for '{where}.schema': expected a JSON Schema object.", f"{where}.schema",
                          "invalid_type")
    problem = ref_problem(schema)
    if problem:
        raise bad_request(f"Invalid schema for response_format '{name}': {problem}", f"{where}.schema")
    return Guide("json_schema", _compact(schema), f"{where}.schema")


def _pointer(schema: dict, ref: str) -> Any:
    """The node a local ``$ref`` ("#", "#/a/b", JSON Pointer escapes ~0 ~1) names; KeyError when there is none."""
    if ref == "#":
        return schema
    if not ref.startswith("#/"):
        raise KeyError(ref)
    node: Any = schema
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise KeyError(ref)
    return node


def _refs(node: Any, at: str = "#"):
    """Every ``$ref`` in the schema, with where it is."""
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield at, node["$ref"]
        for key, value in node.items():
            if key not in ("enum", "const", "examples", "default"):  # data, not schemas
                yield from _refs(value, f"{at}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _refs(value, f"{at}/{i}")


def ref_problem(schema: dict) -> str | None:
    """Why the schema's ``$ref``s cannot be used (one that is not local or does not resolve, a chain of them that
    comes back to where it began), or None."""
    for at, ref in _refs(schema):
        seen = [ref]
        while True:
            try:
                target = _pointer(schema, seen[-1])
            except KeyError:
                return (f"the $ref '{seen[-1]}' (at {at}) does not resolve: only references within the schema "
                        "('#/$defs/…') are supported.")
            nxt = target.get("$ref") if isinstance(target, dict) else None
            if not isinstance(nxt, str):
                break
            if nxt in seen:
                return f"the $ref chain at {at} loops: {' -> '.join([*seen, nxt])}; it matches no value."
            seen.append(nxt)
    return None


def refusal(error: str, guide: Guide | None) -> ApiError | None:
    """The 400 for a backend error that refused the request's guide (it names the guide input); None otherwise."""
    if guide is None or GUIDE_INPUT not in error:
        return None
    reason = error.split(f"{GUIDE_INPUT}:", 1)[-1].strip() or error
    return bad_request(f"Invalid schema for '{guide.param}': {reason}", guide.param)
