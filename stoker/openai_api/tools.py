"""Tool calls (OpenAI's ``tools``, ``tool_choice``, ``parallel_tool_calls``) ⇄ the model's chat template and output.
Pure.

    OpenAI                                  here
    tools [{"type": "function",              validated (name ^[A-Za-z0-9_-]{1,64}$, unique; parameters an object
       "function": {name, description,       schema), then handed to the model's own chat template as ``tools``, as
       parameters}}]                         OpenAI sends them (400 when the template never mentions tools)
    tool_choice "auto" (default)             the output is free; a tool call in the model's own format is parsed
                                             out of it (``parse``), else the output is plain content
    tool_choice "none"                       the template gets no tools; the output is plain content
    tool_choice "required"                   a JSON-schema guide (structured.Guide): with parallel_tool_calls an
                                             array of one or more calls, without it exactly one call
    tool_choice {"type": "function",          a guide: exactly one call of that function
       "function": {"name"}}
    messages: assistant ``tool_calls``       ``function.arguments`` (a JSON string) parsed to a value, as chat
              tool ``tool_call_id``          templates read it (Llama 3.1's writes ``arguments | tojson``)

A guided (forced) call is the JSON ``{"name": "<function>", "arguments": {...}}`` (an array of them for "required"
with parallel calls): one shape for every model family, whatever its template teaches, since the grammar decides.
The response: ``message.tool_calls`` [{"id", "type": "function", "function": {"name", "arguments": JSON text}}],
``content`` null (or the text before the calls), ``finish_reason`` "tool_calls". ``functions``/``function_call``
(OpenAI's deprecated spelling) stay refused (mapping.UNSUPPORTED): one spelling to get right.

Streamed, an answer with tools in play is read whole, then parsed and sent (app._tool_answer): a call is never sent
half as content before it is recognised. The LLM-API target renders the template in this service too, so "auto"
works there; a forced choice needs a guide, which that target cannot take (a 400).
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

from .mapping import ApiError, ChatRequest, bad_request, chat_messages
from .structured import Guide, ref_problem

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
CHOICES = ("none", "auto", "required")

# Template families, told apart by what the template writes (checked in this order). The formats are those vLLM's
# tool parsers read (vllm/entrypoints/openai/tool_parsers/: mistral_tool_parser.py, hermes_tool_parser.py,
# llama_tool_parser.py).
MISTRAL, HERMES, LLAMA, JSON_CALL = "mistral", "hermes", "llama", "json"


def family(template: str | None) -> str:
    """Which output format the model was taught: Mistral's ``[TOOL_CALLS][{...}]``, Hermes' (Qwen2's)
    ``<tool_call>{...}</tool_call>``, Llama 3.1's bare JSON object; any other template: a bare JSON object or array."""
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return MISTRAL
    if "<tool_call>" in t:
        return HERMES
    if "<|python_tag|>" in t or "ipython" in t:
        return LLAMA
    return JSON_CALL


# ---------------------------------------------------------------- the request


@dataclass(frozen=True)
class ToolUse:
    """What a chat request asks of tools. ``choice``: "auto", "none", "required" or "function" (``named``)."""

    tools: tuple[dict, ...]
    choice: str
    named: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        """The output may hold tool calls (and is parsed for them)."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    def template_tools(self) -> list[dict] | None:
        return list(self.tools) if self.active else None


def _check_tool(i: int, tool: Any) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise bad_request(f"Invalid type for '{where}': expected an object.", where, "invalid_type")
    if tool.get("type") != "function":
        raise bad_request(f"Invalid value for '{where}.type': {tool.get('type')!r}; only 'function' is supported.",
                          f"{where}.type")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise bad_request(f"Missing required parameter: '{where}.function'.", f"{where}.function",
                          "missing_required_parameter")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request(f"Invalid value for '{where}.function.name': it must be 1 to 64 letters, digits, "
                          "underscores or dashes.", f"{where}.function.name")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise bad_request(f"Invalid type for '{where}.function.description': expected a string.",
                          f"{where}.function.description", "invalid_type")
    params = fn.get("parameters")
    # OpenAI's rule: the parameters are a JSON Schema object whose type, when given, is "object"; absent: none.
    if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
        raise bad_request(f"Invalid schema for function '{name}': 'parameters' must be a JSON Schema of type "
                          "'object'.", f"{where}.function.parameters")
    if params is not None:
        problem = ref_problem(params)
        if problem:
            raise bad_request(f"Invalid schema for function '{name}': {problem}", f"{where}.function.parameters")
    return tool


def parse_tools(obj: dict) -> ToolUse | None:
    """The request body's tool fields, checked; None when it has none (``tools`` absent or empty)."""
    tools = obj.get("tools")
    choice = obj.get("tool_choice")
    parallel = obj.get("parallel_tool_calls")
    parallel = True if parallel is None else parallel  # null: the default, as an omitted field
    if tools is not None and not isinstance(tools, list):
        raise bad_request("Invalid type for 'tools': expected an array of tools.", "tools", "invalid_type")
    if not isinstance(parallel, bool):
        raise bad_request("Invalid type for 'parallel_tool_calls': expected a boolean.", "parallel_tool_calls",
                          "invalid_type")
    if not tools:
        if choice is not None:
            raise bad_request("Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are "
                              "specified.", "tool_choice")
        return None
    checked = tuple(_check_tool(i, t) for i, t in enumerate(tools))
    names = [t["function"]["name"] for t in checked]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise bad_request(f"Invalid value for 'tools[{i}].function.name': '{name}' is declared twice.",
                              f"tools[{i}].function.name")
    if choice is None or choice in CHOICES:
        return ToolUse(checked, choice or "auto", None, parallel)
    if isinstance(choice, str):
        raise bad_request(f"Invalid value for 'tool_choice': {choice!r}. Supported values are: 'none', 'auto', "
                          "'required', or an object naming a function.", "tool_choice")
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(choice.get("function"), dict):
        raise bad_request("Invalid value for 'tool_choice': expected {\"type\": \"function\", \"function\": "
                          "{\"name\": ...}}.", "tool_choice")
    name = choice["function"].get("name")
    if name not in names:
        raise bad_request(f"Invalid value for 'tool_choice': no function named {name!r} is in 'tools'.",
                          "tool_choice")
    return ToolUse(checked, "function", name, parallel)


def template_refusal(use: ToolUse | None, template: str | None) -> ApiError | None:
    """The 400 when the request's tools would reach a chat template that never reads them (they would be
    silently dropped, and the model never told of them); None otherwise."""
    if use is None or not use.active:
        return None
    if template is None or "tools" not in template:
        return bad_request("'tools' are not supported by this model: its chat template does not render tools.",
                           "tools", "unsupported_parameter")
    return None


# ---------------------------------------------------------------- the guide (forced calls)


def _rebased(node: Any, base: str) -> Any:
    """The schema with every local ``$ref`` ("#…") pointing into ``base`` ("#/$defs/…") instead of its own root."""
    if isinstance(node, list):
        return [_rebased(v, base) for v in node]
    if not isinstance(node, dict):
        return node
    return {k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
                else v if k in ("enum", "const", "examples", "default") else _rebased(v, base))
            for k, v in node.items()}


def call_schema(use: ToolUse) -> dict | None:
    """The JSON schema a forced choice constrains the output to; None when the output is free.

    A function's parameters sit inside the call's object, so their own ``$ref``s ("#/$defs/x", written against the
    parameters' root) would resolve against the call's root: parameters that use any move into the root's
    ``$defs`` (as ``tool_<name>``), their references rebased there."""
    if not use.forced:
        return None
    defs: dict[str, Any] = {}

    def one(tool: dict) -> dict:
        name, params = tool["function"]["name"], tool["function"].get("parameters") or {"type": "object"}
        if '"$ref"' in json.dumps(params):
            defs[f"tool_{name}"] = _rebased(params, f"#/$defs/tool_{name}")
            params = {"$ref": f"#/$defs/tool_{name}"}
        return {"type": "object", "properties": {"name": {"const": name}, "arguments": params},
                "required": ["name", "arguments"], "additionalProperties": False}

    if use.choice == "function":
        schema = one(next(t for t in use.tools if t["function"]["name"] == use.named))
    else:
        calls = [one(t) for t in use.tools]
        call = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = {"type": "array", "items": call, "minItems": 1} if use.parallel else call
    return {**schema, "$defs": defs} if defs else schema


def guide(use: ToolUse | None, response_guide: Guide | None, llmapi: bool = False) -> Guide | None:
    """The guide to send: the forced tool call's, else ``response_format``'s. Both at once is a 400 (one output
    cannot follow two schemas); so is a forced choice where the backend takes no guide (the LLM API's model)."""
    schema = call_schema(use) if use is not None else None
    if schema is None:
        return response_guide
    if response_guide is not None:
        raise bad_request("'response_format' cannot be combined with a 'tool_choice' that forces a call ('required' "
                          "or a named function): the call's arguments follow the function's own schema.",
                          "tool_choice")
    if llmapi:
        raise bad_request(f"'tool_choice' {use.named or use.choice!r} is not supported by this deployment: it serves "
                          "TensorRT-LLM's LLM-API model (target: pytorch), which has no per-request guide input to "
                          "force a call; use 'auto'.", "tool_choice", "unsupported_value")
    # Compact, key order kept (the order properties are generated in), as structured.py sends response_format's.
    return Guide("json_schema", json.dumps(schema, ensure_ascii=False, separators=(",", ":")), "tools")


# ---------------------------------------------------------------- messages


def messages(req: ChatRequest) -> list[dict]:
    """Messages as chat templates read them (mapping.chat_messages), with an assistant's ``tool_calls`` (arguments
    parsed from their JSON text) and a tool message's ``tool_call_id`` (and its function's ``name``, which some
    templates write) kept."""
    out = chat_messages(req)
    names: dict[str, str] = {}
    for i, (m, msg) in enumerate(zip(req.messages, out)):
        if m.tool_calls:
            if m.role != "assistant":
                raise bad_request(f"Invalid parameter: only assistant messages can carry 'tool_calls' (this one is "
                                  f"'{m.role}').", f"messages[{i}].tool_calls")
            msg["tool_calls"] = [_template_call(f"messages[{i}].tool_calls[{j}]", c, names)
                                 for j, c in enumerate(m.tool_calls)]
        if m.role == "tool":
            if not m.tool_call_id:
                raise bad_request(f"Missing required parameter: 'messages[{i}].tool_call_id'.",
                                  f"messages[{i}].tool_call_id", "missing_required_parameter")
            msg["tool_call_id"] = m.tool_call_id
            if "name" not in msg and m.tool_call_id in names:
                msg["name"] = names[m.tool_call_id]
    return out


def _template_call(where: str, call: Any, names: dict[str, str]) -> dict:
    if not isinstance(call, dict):
        raise bad_request(f"Invalid type for '{where}': expected an object.", where, "invalid_type")
    fn = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(fn, dict):
        raise bad_request(f"Invalid value for '{where}': expected {{\"type\": \"function\", \"function\": {{...}}}}.",
                          where)
    if not isinstance(call.get("id"), str):
        raise bad_request(f"Missing required parameter: '{where}.id'.", f"{where}.id", "missing_required_parameter")
    if not isinstance(fn.get("name"), str):
        raise bad_request(f"Missing required parameter: '{where}.function.name'.", f"{where}.function.name",
                          "missing_required_parameter")
    raw = fn.get("arguments")
    if not isinstance(raw, str):
        raise bad_request(f"Invalid type for '{where}.function.arguments': expected a JSON string.",
                          f"{where}.function.arguments", "invalid_type")
    try:
        arguments = json.loads(raw) if raw.strip() else {}
    except ValueError:
        raise bad_request(f"Invalid value for '{where}.function.arguments': not valid JSON.",
                          f"{where}.function.arguments") from None
    names[call["id"]] = fn["name"]
    return {"id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": arguments}}


# ---------------------------------------------------------------- the output


@dataclass(frozen=True)
class Call:
    name: str
    arguments: Any  # the value; sent as JSON text


def _as_call(obj: Any, names: frozenset[str]) -> Call | None:
    # Llama 3.1's templates teach "parameters"; Mistral's and Hermes' "arguments": either is read.
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return Call(obj["name"], args)


def _calls(value: Any, names: frozenset[str]) -> list[Call] | None:
    """A call or a list of calls, every one naming a declared tool; None otherwise."""
    items = value if isinstance(value, list) else [value]
    calls = [_as_call(v, names) for v in items]
    return calls if calls and all(calls) else None


def _json_values(text: str) -> list[Any] | None:
    """``text`` as one or more JSON values (Llama 3.1 may separate calls with ';'); None if it is not."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i == len(text):
            return values or None
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


def parse(text: str, use: ToolUse, template: str | None) -> tuple[str | None, list[Call]]:
    """(content, calls) of one output; no call parsed: (text, []). A forced output is the guide's JSON; a free one
    is read in its template family's format: ``[TOOL_CALLS]`` and Llama's ``<|python_tag|>`` are special tokens the
    detokenizer drops (mapping's decode skips them), so the JSON after them is read with or without them."""
    names = frozenset(t["function"]["name"] for t in use.tools)
    if not use.active:
        return text, []
    body = text.strip()
    if use.forced:
        values = _json_values(body)
        calls = _calls(values[0] if values and len(values) == 1 else None, names)
        return (None, calls) if calls else (text, [])
    fam = family(template)
    if fam == HERMES and "<tool_call>" in text:
        before = text[:text.index("<tool_call>")]
        found: list[Call] = []
        for raw in _HERMES.findall(text):
            values = _json_values(raw.strip())
            calls = _calls(values[0], names) if values and len(values) == 1 else None
            if not calls:
                return text, []
            found += calls
        return (before.strip() or None), found
    for prefix in ("[TOOL_CALLS]", "<|python_tag|>"):
        body = body.removeprefix(prefix).lstrip()
    values = _json_values(body)
    if not values:
        return text, []
    calls = _calls(values[0], names) if len(values) == 1 else _calls(values, names)
    return (None, calls) if calls else (text, [])


# What a free output that holds a call starts with (after whitespace): JSON, or a format's own marker.
_OPENERS = ("{", "[", "<tool_call>", "[TOOL_CALLS]", "<|python_tag|>")
_HERMES_OPEN = "<tool_call>"


class Holding:
    """A streamed output with tools in play: ``push`` each piece of text, send what it returns as content, and at the
    end ``finish`` gives the rest of the content and the calls, as ``parse`` reads the whole.

    A forced output is held whole (it is the call). A free one is held only while it may be a call: until its start
    shows it cannot open one (the formats vLLM reads put a call first), then it streams as content; in Hermes'
    family a call may follow text, so there the text streams up to a ``<tool_call>`` (a partial tag at the end is
    held back a moment) and the rest is held."""

    def __init__(self, use: ToolUse, template: str | None) -> None:
        self.use, self.template = use, template
        self.hermes = family(template) == HERMES
        self.held = ""
        self.holding = use.forced  # from here to the end, everything is held
        self.started = use.forced  # the start is decided

    def push(self, piece: str) -> str:
        self.held += piece
        if self.holding:
            return ""
        if not self.started:
            start = self.held.lstrip()
            if not start or any(o.startswith(start) for o in _OPENERS):
                return ""  # whitespace, or the beginning of an opener: not decided yet
            self.started = True
            if start.startswith(_OPENERS):
                self.holding = True
                return ""
        if not self.hermes:
            out, self.held = self.held, ""
            return out
        if _HERMES_OPEN in self.held:
            cut = self.held.index(_HERMES_OPEN)
            out, self.held, self.holding = self.held[:cut], self.held[cut:], True
            return out
        keep = next((n for n in range(len(_HERMES_OPEN) - 1, 0, -1) if self.held.endswith(_HERMES_OPEN[:n])), 0)
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out

    def finish(self) -> tuple[str | None, list[Call]]:
        """(content not yet sent, calls)."""
        if not self.holding:
            return self.held or None, []
        content, calls = parse(self.held, self.use, self.template)
        return (content or None), calls


_ALNUM = string.ascii_letters + string.digits


def call_id(template: str | None) -> str:
    """A fresh id: OpenAI's ``call_…``; 9 letters and digits for Mistral's family, whose templates refuse any
    other id when the call comes back in the history (as vLLM's Mistral parser makes them)."""
    if family(template) == MISTRAL:
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return "call_" + secrets.token_hex(12)


def tool_calls(calls: list[Call], template: str | None) -> list[dict]:
    """The calls in OpenAI's shape: ``arguments`` as JSON text."""
    return [{"id": call_id(template), "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
            for c in calls]


def attach(body: dict, content: str | None, calls: list[dict]) -> dict:
    """A chat.completion body (mapping.chat_response) given the calls: content, tool_calls, finish "tool_calls"."""
    choice = body["choices"][0]
    choice["message"]["content"] = content
    if calls:
        choice["message"]["tool_calls"] = calls
        choice["finish_reason"] = "tool_calls"
    return body


def deltas(content: str | None, calls: list[dict]) -> list[dict]:
    """The streamed deltas of a buffered answer: its content, then per call one delta opening it (id, name, empty
    arguments) and one with its arguments, as OpenAI streams them and its client assembles them."""
    out = [{"content": content}] if content else []
    for i, c in enumerate(calls):
        fn = c["function"]
        out.append({"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                                    "function": {"name": fn["name"], "arguments": ""}}]})
        out.append({"tool_calls": [{"index": i, "function": {"arguments": fn["arguments"]}}]})
    return out
