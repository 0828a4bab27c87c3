"""The OpenAI service (stoker/openai_api) fuzzed from its own request models.

Every route (/v1/models, /v1/models/{name}, /v1/completions, /v1/chat/completions), every parameter
``mapping.ChatRequest`` / ``CompletionRequest`` define plus those read from the raw body (response_format, tools,
tool_choice, parallel_tool_calls, the UNSUPPORTED ones), streamed and not. Each parameter is absent, valid,
at or past a boundary, or any JSON value at all; around that: unknown fields, bodies that are not JSON, not UTF-8,
not an object, nested deep; wrong methods, paths and content types; no, a wrong, a malformed and (when the
deployment asks one) the right API key.

Invariants (``check``): no 5xx but the documented 503 (backend unavailable), every error in OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``, a request every part of which is valid answered 200 (a stream:
events that parse, ending in ``[DONE]``), and a canary client answered throughout.
"""

from __future__ import annotations

import json
import urllib.parse
from dataclasses import dataclass, field

import httpx
from hypothesis import strategies as st

from . import Tally, Target
from ._drive import Canary, drive

SURFACE = "openai"
ERROR_FIELDS = {"message", "type", "param", "code"}
DOCUMENTED_5XX = {(503, "backend_unavailable")}
TOKEN_IDS = 1000  # below every vocabulary stoker serves (the tiny Llama's is 2,048)
TIMEOUT_S = 60.0
# Known to mapping.UNSUPPORTED: a value other than "off" is refused, not ignored.
UNSUPPORTED = ("functions", "function_call", "best_of", "echo", "suffix")
ROUTES = ("/models", "/completions", "/chat/completions")


@dataclass
class Case:
    method: str
    path: str  # under the base, e.g. /chat/completions
    body: bytes | None = None
    headers: dict[str, bytes] = field(default_factory=dict)
    valid: bool = False  # every part valid: must be answered 200
    stream: bool = False
    keyed: bool = True  # carries the right key (or the deployment asks none)

    def describe(self) -> str:
        shown = {k: v.decode("latin-1") if k != "authorization" else "<key>" for k, v in self.headers.items()}
        body = (self.body or b"")[:300].decode("utf-8", "replace")
        return f"{self.method} {self.path} {shown} {body}"


# ---------------------------------------------------------------- values

ANY = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
                   lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                   max_leaves=8)
BIG_INTS = st.sampled_from([-1, 0, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, -(2**63), 10**30, 10**400])
ODD_FLOATS = st.sampled_from([-1e-9, -0.0, 2.0000001, 1e308, -1e308, float("inf"), float("-inf"), float("nan")])
TEXT = st.text(max_size=40)
SOME_TEXT = st.text(st.characters(exclude_categories=("Cs", "Zs", "Cc")), min_size=1, max_size=30)


def _param(valid: st.SearchStrategy, bad: st.SearchStrategy, p_bad: float) -> st.SearchStrategy[tuple[str, object]]:
    """(how it was drawn, the value): absent or valid, else (with probability ``p_bad``) a bad or boundary value or
    any JSON value at all."""
    fine = st.one_of(st.just(("absent", None)), valid.map(lambda v: ("valid", v)))
    if p_bad <= 0:
        return fine
    wrong = st.one_of(bad.map(lambda v: ("bad", v)), ANY.map(lambda v: ("any", v)))
    return st.floats(0, 1).flatmap(lambda x: wrong if x < p_bad else fine)


def _token_ids(n: int = 12) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, TOKEN_IDS - 1), min_size=1, max_size=n)


SCHEMA = st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(
    st.from_regex(r"[a-z]{1,6}", fullmatch=True),
    st.sampled_from([{"type": "string", "maxLength": 6}, {"type": "integer"}, {"type": "boolean"},
                     {"enum": ["a", "b"]}]), max_size=3)})
RESPONSE_FORMAT_OK = st.one_of(
    st.just({"type": "text"}), st.just({"type": "json_object"}),
    st.builds(lambda name, schema, strict: {"type": "json_schema",
                                            "json_schema": {"name": name, "schema": schema, "strict": strict}},
              st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True), SCHEMA, st.booleans()))
RESPONSE_FORMAT_BAD = st.one_of(
    st.builds(lambda t: {"type": t}, ANY), st.just({"type": "json_schema"}),
    st.builds(lambda j: {"type": "json_schema", "json_schema": j}, ANY),
    st.builds(lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}, ANY),
    st.just({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}),
    st.just({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}),
    st.just({"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {"type": "object"}}}))
TOOL_OK = st.builds(lambda name, schema, desc: {"type": "function", "function": {
    "name": name, "parameters": schema, **({"description": desc} if desc else {})}},
    st.from_regex(r"[A-Za-z0-9_-]{1,20}", fullmatch=True), SCHEMA, st.none() | TEXT)
TOOL_BAD = st.one_of(ANY, st.builds(lambda f: {"type": "function", "function": f}, ANY),
                     st.builds(lambda t: {"type": t, "function": {"name": "f"}}, ANY),
                     st.builds(lambda p: {"type": "function", "function": {"name": "f", "parameters": p}}, ANY))


# ---------------------------------------------------------------- bodies


BAD_MESSAGES = st.sampled_from([
    [], [{"role": "bot", "content": "hi"}], [{"role": "user"}], [{"content": "hi"}],
    [{"role": "user", "content": [{"type": "image_url"}]}], [{"role": "tool", "content": "x"}],
    [{"role": "user", "content": "x", "tool_calls": [{"id": 1}]}],
    [{"role": "assistant", "content": None, "tool_calls": [{"type": "function",
                                                             "function": {"name": "f", "arguments": "{"}}]}],
    [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                             "function": {"name": "f", "arguments": "[1"}}]}],
    "hello", [None], [{"role": 7, "content": 7}]])
MESSAGE = st.one_of(
    st.builds(lambda r, c: {"role": r, "content": c}, st.sampled_from(["system", "developer", "user"]), TEXT),
    st.builds(lambda c: {"role": "user", "content": [{"type": "text", "text": t} for t in c]},
              st.lists(TEXT, min_size=1, max_size=3)),
    st.builds(lambda c: {"role": "assistant", "content": c}, st.none() | TEXT))
MESSAGES = st.builds(lambda before, last: [*before, {"role": "user", "content": last}],
                     st.lists(MESSAGE, max_size=2), SOME_TEXT)
PROMPT = st.one_of(SOME_TEXT, st.lists(SOME_TEXT, min_size=1, max_size=1), _token_ids(),
                   _token_ids().map(lambda v: [v]))
BAD_PROMPT = st.sampled_from([[], [[]], ["a", "b"], [[1], [2]], [-1], [10**9], [1.5], "", [True], [2**40]])
OFF = {"functions": [], "function_call": "none", "best_of": 1, "echo": False, "suffix": ""}


def _needed(valid: st.SearchStrategy, bad: st.SearchStrategy, p_bad: float) -> st.SearchStrategy:
    """A parameter the request needs: valid, else (with probability ``p_bad``) bad, any value, or absent."""
    return _param(valid, bad, p_bad).filter(lambda d: d[0] != "absent") | (
        st.just(("absent-needed", None)) if p_bad else st.nothing())


@st.composite
def _body(draw, chat: bool, model: str) -> tuple[dict, bool, bool]:
    """A request body for chat or completions: (body, every part valid, streamed). Most bodies are valid or have a
    few parameters wrong, so the server's answering paths are fuzzed too, not only its first check."""
    p_bad = draw(st.sampled_from([0.0, 0.0, 0.0, 0.06, 0.06, 0.3]))
    drawn: dict[str, tuple[str, object]] = {}
    drawn["model"] = draw(_needed(st.just(model), TEXT, p_bad))
    if chat:
        drawn["messages"] = draw(_needed(MESSAGES, BAD_MESSAGES, p_bad))
    else:
        drawn["prompt"] = draw(_needed(PROMPT, BAD_PROMPT, p_bad))
    length = "max_completion_tokens" if chat and draw(st.booleans()) else "max_tokens"
    # Chat without a length may generate the whole context: it always has one (completions' default is 16).
    drawn[length] = draw((_needed if chat else _param)(st.integers(1, 8), BIG_INTS, p_bad))
    drawn["temperature"] = draw(_param(st.floats(0, 2), ODD_FLOATS | st.floats(2.0001, 10) | st.just(-0.5), p_bad))
    drawn["top_p"] = draw(_param(st.floats(0, 1), ODD_FLOATS | st.just(1.5), p_bad))
    drawn["seed"] = draw(_param(st.integers(-(2**63), 2**64 - 1), BIG_INTS | st.just(1.5), p_bad))
    drawn["stop"] = draw(_param(TEXT | st.lists(TEXT, max_size=4), st.lists(TEXT, min_size=5, max_size=6), p_bad))
    drawn["n"] = draw(_param(st.integers(1, 3), BIG_INTS | st.just(9), p_bad))
    drawn["stream"] = draw(_param(st.booleans(), st.sampled_from(["true", 1, 0]), p_bad))
    drawn["frequency_penalty"] = draw(_param(st.floats(-2, 2), ODD_FLOATS | st.just(2.5), p_bad))
    drawn["presence_penalty"] = draw(_param(st.floats(-2, 2), ODD_FLOATS | st.just(-2.5), p_bad))
    drawn["logit_bias"] = draw(_param(
        st.dictionaries(st.integers(0, TOKEN_IDS - 1).map(str), st.floats(-100, 100), max_size=3),
        st.sampled_from([{"-1": 1}, {"abc": 1}, {"1": 101}, {"99999999": 1}, {"٣": 1}, {"1": float("nan")}]), p_bad))
    drawn["ignore_eos"] = draw(_param(st.booleans(), st.just("yes"), p_bad))
    drawn["min_tokens"] = draw(_param(st.integers(0, 1), BIG_INTS | st.just(-1), p_bad))
    if chat:
        logprobs = draw(_param(st.booleans(), st.just(1), p_bad))
        drawn["logprobs"] = logprobs
        top = st.integers(0, 5) if logprobs == ("valid", True) else st.just(0)
        drawn["top_logprobs"] = draw(_param(top, st.sampled_from([-1, 21, 2**31]), p_bad))
        drawn["tools"] = draw(_param(st.lists(TOOL_OK, min_size=1, max_size=2,
                                              unique_by=lambda t: t["function"]["name"]),
                                     st.lists(TOOL_BAD, max_size=2) | st.just("f"), p_bad))
        names = [t["function"]["name"] for t in drawn["tools"][1]] if drawn["tools"][0] == "valid" else []
        choices = ["none", "auto"] + (["required", *({"type": "function", "function": {"name": n}} for n in names)]
                                      if names else [])
        # tool_choice without tools is refused (as OpenAI does): valid only beside them.
        drawn["tool_choice"] = draw(_param(st.sampled_from(choices) if names else st.nothing(), st.sampled_from(
            ["always", {"type": "function"}, {"type": "function", "function": {"name": "nope"}}]), p_bad))
        drawn["parallel_tool_calls"] = draw(_param(st.booleans(), st.just("no"), p_bad))
    else:
        drawn["logprobs"] = draw(_param(st.integers(0, 5), st.sampled_from([-1, 6, 2**31]), p_bad))
    drawn["response_format"] = draw(_param(RESPONSE_FORMAT_OK, RESPONSE_FORMAT_BAD, p_bad))
    streamed = drawn["stream"] == ("valid", True)
    drawn["stream_options"] = draw(_param(st.builds(lambda u: {"include_usage": u}, st.booleans())
                                          if streamed else st.nothing(), st.just({"include_usage": "yes"}), p_bad))
    for name in draw(st.lists(st.sampled_from(UNSUPPORTED), max_size=1, unique=True)):
        drawn[name] = draw(_needed(st.just(OFF[name]), ANY, p_bad))
    body = {k: v for k, (how, v) in drawn.items() if not how.startswith("absent")}
    valid = all(how in ("valid", "absent") for how, _ in drawn.values())
    if chat and valid:
        # What the service refuses by design, not by fault: tools with n > 1, a forced call with response_format.
        forcing = body.get("tool_choice") not in (None, "none", "auto") and "tools" in body
        if ("tools" in body and body.get("tool_choice") != "none" and body.get("n", 1) > 1) or (
                forcing and body.get("response_format", {}).get("type", "text") != "text"):
            valid = False
    # Unknown fields are ignored, as vLLM ignores them.
    extra = draw(st.dictionaries(st.from_regex(r"x_[a-z]{1,8}", fullmatch=True), ANY, max_size=2))
    return {**body, **extra}, valid, streamed


# ---------------------------------------------------------------- requests


@st.composite
def _auth(draw, key: str | None) -> tuple[dict[str, bytes], bool]:
    """The authorization header: the right key (when there is one), none, wrong, malformed, not ASCII."""
    options = ["none", "wrong", "malformed", "latin1", "long"] + (["right"] * 6 if key else ["none"] * 6)
    how = draw(st.sampled_from(options))
    value = {"right": f"Bearer {key}".encode() if key else b"", "none": b"", "wrong": b"Bearer sk-wrong-key-0000",
             "malformed": draw(st.sampled_from([b"Bearer", b"Basic Zm9vOmJhcg==", b"bearer  x", b"Bearer a b",
                                                b"Bearer \"x\""])),
             "latin1": "Bearer cl\u00e9".encode("latin-1"), "long": b"Bearer " + b"k" * 8000}[how]
    # Without keys the service passes a plausible header on; one no key can be (latin1, long) is refused 401.
    return ({"authorization": value} if value else {}), how == "right" or (not key and how not in ("latin1", "long"))


CONTENT_TYPES = [b"application/json", b"application/json; charset=utf-8", b"text/plain", b"", b"multipart/form-data",
                 b"application/x-www-form-urlencoded", "application/j\u00e9son".encode("latin-1")]


@st.composite
def cases(draw, target: Target) -> Case:
    headers, keyed = draw(_auth(target.api_key))
    kind = draw(st.sampled_from(["chat"] * 5 + ["completions"] * 4 + ["models", "model", "route", "raw"]))
    if not target.api_key:
        keyed = keyed or kind in ("models", "model")  # the service alone checks a header only where it forwards it
    if kind == "models":
        return Case("GET", "/models", None, headers, keyed, False, keyed)
    if kind == "model":
        name = draw(st.one_of(st.just(target.model or "tiny"), st.text(min_size=1, max_size=20)))
        path = "/models/" + urllib.parse.quote(name.encode("utf-8", "surrogatepass"), safe="/")
        return Case("GET", path, None, headers, False, False, keyed)
    if kind == "route":  # a wrong method or an unknown path
        method = draw(st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "POST", "OPTIONS"]))
        path = draw(st.sampled_from([*ROUTES, "/chat/completions/", "/completion", "/embeddings", "/models/a/b/c",
                                     "/../v2/health", "/%ff", "/chat/completions?x=%zz"]))
        return Case(method, path, b"{}" if method in ("POST", "PUT", "PATCH") else None, headers, False, False, keyed)
    chat = kind == "chat" or (kind == "raw" and draw(st.booleans()))
    path = "/chat/completions" if chat else "/completions"
    headers["content-type"] = draw(st.sampled_from(CONTENT_TYPES))
    if kind == "raw":  # not a JSON object at all
        raw = draw(st.one_of(
            st.binary(max_size=200), st.sampled_from([b"", b"null", b"[]", b"42", b'"x"', b"{", b'{"model": }',
                                                     b"[" * 50_000 + b"]" * 50_000, b"{\"a\":" * 20_000,
                                                     b'{"model": "\xff\xfe"}', b'{"model": "\\ud800"}',
                                                     b'{"model": 1e999999}', b'{"model": "x", "model": 1}',
                                                     b"\xef\xbb\xbf{}", b'{"prompt": "' + b"9" * 5000 + b'"}']),
            ANY.map(lambda v: json.dumps(v).encode())))
        return Case("POST", path, raw, headers, False, False, keyed)
    body, valid, stream = draw(_body(chat, target.model or "tiny"))
    raw = json.dumps(body, ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")
    return Case("POST", path, raw, headers, valid and keyed, stream, keyed)


# ---------------------------------------------------------------- checks


def _error_shape(body: object) -> str | None:
    """What is wrong with an error body's shape (None: OpenAI's)."""
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict):
        return "not {'error': {...}}"
    err = body["error"]
    if set(err) != ERROR_FIELDS:
        return f"error fields {sorted(err)}"
    if not (isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)):
        return "message or type not a non-empty string"
    if not all(err[k] is None or isinstance(err[k], str) for k in ("param", "code")):
        return "param or code neither a string nor null"
    return None


def _stream_problem(lines: list[str]) -> str | None:
    events = [line[6:] for line in lines if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return "a stream that does not end in [DONE]"
    for event in events[:-1]:
        try:
            obj = json.loads(event)
        except ValueError:
            return f"an event that is not JSON: {event[:80]}"
        if "error" in obj:
            return f"an error event: {event[:200]}"
    return None


class Checker:
    def __init__(self, client: httpx.Client, tally: Tally, keys_asked: bool) -> None:
        self.client, self.tally, self.keys_asked = client, tally, keys_asked

    def __call__(self, case: Case) -> None:
        try:
            status, problem, detail = self._send(case)
        except httpx.TimeoutException:
            status, problem, detail = "timeout", "no answer within the timeout", ""
        except httpx.HTTPError as err:
            status, problem, detail = "no-answer", f"connection failed: {type(err).__name__}", str(err)
        self.tally.saw(status)
        if problem:
            self.tally.broke(f"{case.method} {case.path.split('?')[0]}: {problem}", f"{detail} <- {case.describe()}")

    def _send(self, case: Case) -> tuple[int, str | None, str]:
        if case.stream:
            with self.client.stream(case.method, case.path, content=case.body, headers=case.headers) as r:
                if r.status_code == 200:
                    lines = list(r.iter_lines())
                    problem = _stream_problem(lines)
                    return 200, problem, "\n".join(lines)[-300:] if problem else ""
                r.read()
        else:
            r = self.client.request(case.method, case.path, content=case.body, headers=case.headers)
        return r.status_code, self._problem(case, r), r.text[:300]

    def _problem(self, case: Case, r: httpx.Response) -> str | None:
        status = r.status_code
        if status == 307 and case.path.endswith("/") and r.headers.get("location", "").endswith(case.path[:-1]):
            return None  # Starlette's redirect to the route without the trailing slash: no error
        try:
            body = r.json()
        except ValueError:
            return f"{status} with a body that is not JSON"
        if status < 300:
            if not case.keyed:
                return f"{status} without the API key"
            return None if isinstance(body, dict) and "object" in body else f"{status} with an odd body"
        if shape := _error_shape(body):
            return f"{status} error in the wrong shape ({shape})"
        if status >= 500 and (status, body["error"]["code"]) not in DOCUMENTED_5XX:
            return f"{status} {body['error']['type']}/{body['error']['code']}: {body['error']['message'][:100]}"
        if self.keys_asked and not case.keyed and status != 401:
            return f"{status} without the API key (401 expected)"
        if case.valid:
            return f"a valid request refused: {status} {body['error']['param']}/{body['error']['code']}"
        return None


def valid_answer(client: httpx.Client, target: Target) -> str | None:
    """One small valid chat request, as any other client would send it: None when answered right."""
    headers = {"authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    r = client.post("/chat/completions", headers=headers, json={
        "model": target.model, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 4})
    if r.status_code != 200 or not r.json().get("choices"):
        return f"{r.status_code}: {r.text[:200]}"
    return None


def run(target: Target, max_examples: int, seed: int) -> Tally:
    """Fuzz the OpenAI service at ``target.openai`` with ``max_examples`` generated requests."""
    if not target.openai or not target.model:
        raise ValueError("the openai surface needs target.openai and target.model")
    tally = Tally(SURFACE)
    with httpx.Client(base_url=target.openai, timeout=TIMEOUT_S) as client, \
            httpx.Client(base_url=target.openai, timeout=TIMEOUT_S) as other:
        with Canary(tally, lambda: valid_answer(other, target)):
            drive(cases(target), Checker(client, tally, bool(target.api_key)), max_examples, seed)
        if problem := valid_answer(other, target):
            tally.broke("after the run: a valid request failed", problem)
    return tally
