"""Triton's inference routes at the stable address, fuzzed (issue 51).

Requests are generated from the entry model's own metadata (``GET /v2/models/<m>``: input names, datatypes,
shapes; ``/config``: which inputs are optional) and then spoiled: a value of the wrong JSON type, a wrong shape,
size or datatype, a missing or extra field, nested junk, huge numbers, a body that is not JSON or not UTF-8, a wrong
content type or encoding. HTTP goes to ``/generate``, ``/generate_stream`` and ``/infer``; gRPC to ``ModelInfer``
and ``ModelStreamInfer`` with raw tensors whose shape, datatype or bytes do not fit.

Invariants: no HTTP 5xx; every HTTP error is KServe's ``{"error": "..."}``; no gRPC INTERNAL, UNKNOWN or
UNAVAILABLE (a malformed request is INVALID_ARGUMENT; Triton says UNIMPLEMENTED for ModelInfer on a decoupled
model); afterwards the server is ready and a valid request still answers.

Not generated: an HTTP ``/infer`` shape with a dimension over MAX_DIM. Triton 2.51 allocates what a JSON request's
``shape`` declares before comparing it with ``data`` (``[4294967296, 1]`` took 12.7 GiB; ``[2**62, 1]`` crashed
tritonserver with SIGSEGV, exit 139) on a model that is not decoupled; the proxy cannot see a shape's product without
parsing JSON. gRPC compares the raw bytes first, so gRPC shapes do go huge.
"""

from __future__ import annotations

import json
import struct
import urllib.error
import urllib.request

from hypothesis import HealthCheck, Phase, given, seed as with_seed, settings, strategies as st

from . import Tally, Target

SURFACE = "triton"
ROUTES = ("generate", "generate_stream", "infer")
MAX_DIM = 64  # see the module's docstring: larger HTTP shapes are a known Triton resource bug, not sent
HUGE = (2**31, 2**31 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -2**63 - 1, 10**30, -1)
DATATYPES = ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64",
             "BF16", "BYTES")
BAD_GRPC = {"INTERNAL", "UNKNOWN", "UNAVAILABLE", "DATA_LOSS"}
TIMEOUT_S = 10.0

# ------------------------------------------------------------------ values, from what the model declares

_text = st.text(max_size=12)
_junk_leaf = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70), st.sampled_from(HUGE),
                       st.floats(allow_nan=False), _text)
# Nested junk: lists and objects of anything, a few levels deep.
JUNK = st.recursive(_junk_leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(_text, inner, max_size=3)), max_leaves=8)


def good_scalar(datatype: str) -> st.SearchStrategy:
    """A value Triton's JSON reader takes for ``datatype``."""
    if datatype == "BYTES":
        return st.text(max_size=16)
    if datatype == "BOOL":
        return st.booleans()
    if datatype.startswith("FP") or datatype == "BF16":
        return st.floats(min_value=-1e3, max_value=1e3, allow_nan=False)
    if datatype.startswith("UINT"):
        return st.integers(min_value=0, max_value=8)
    return st.integers(min_value=-8, max_value=8)


def value_for(datatype: str) -> st.SearchStrategy:
    """A generate field's value: mostly the right type (so the request gets past the first field), else junk."""
    good = good_scalar(datatype)
    return st.one_of(good, good, st.lists(good, max_size=3), JUNK)


@st.composite
def generate_body(draw, inputs: list[dict]) -> dict:
    """/generate's body: the model's inputs as top-level keys, some spoiled, some dropped, some extra."""
    body = {i["name"]: draw(value_for(i["datatype"])) for i in inputs if draw(st.integers(0, 3))}
    if draw(st.booleans()):
        body.update(draw(st.dictionaries(_text, JUNK, max_size=2)))
    if draw(st.integers(0, 4)) == 0:
        body["parameters"] = draw(st.one_of(JUNK, st.dictionaries(_text, JUNK, max_size=2)))
    return body


@st.composite
def infer_tensor(draw, inputs: list[dict]) -> dict:
    """One of /infer's ``inputs``: name, shape, datatype, data; each may be wrong."""
    model = draw(st.sampled_from(inputs)) if inputs else {"name": "x", "datatype": "INT32", "shape": [1]}
    dims = st.integers(min_value=-2, max_value=MAX_DIM)
    shape = [d if d >= 0 else 1 for d in model["shape"]]
    tensor = {"name": draw(st.one_of(st.just(model["name"]), st.just(model["name"]), JUNK)),
              "shape": draw(st.one_of(st.just(shape), st.lists(dims, max_size=3), JUNK.filter(_no_big_dims))),
              "datatype": draw(st.one_of(st.just(model["datatype"]), st.sampled_from(DATATYPES), JUNK)),
              "data": draw(st.one_of(st.lists(good_scalar(model["datatype"]), max_size=4), JUNK))}
    for key in draw(st.lists(st.sampled_from(sorted(tensor)), max_size=2, unique=True)):
        del tensor[key]  # a missing field
    if draw(st.integers(0, 4)) == 0:
        tensor["parameters"] = draw(st.dictionaries(st.sampled_from(["binary_data_size", "shared_memory_region",
                                                                     "shared_memory_byte_size", "x"]), JUNK,
                                                    max_size=2))
    return tensor


def _no_big_dims(value) -> bool:
    """Junk that would read as a huge shape (a list of big integers) is left out (module docstring)."""
    if not isinstance(value, list):
        return True
    return not any(isinstance(v, (int, float)) and abs(v) > MAX_DIM for v in value)


@st.composite
def infer_body(draw, inputs: list[dict]) -> dict:
    body: dict = {"inputs": draw(st.one_of(st.lists(infer_tensor(inputs), max_size=3),
                                           JUNK.filter(_no_big_dims)))}
    if draw(st.integers(0, 3)) == 0:
        body[draw(st.sampled_from(["outputs", "id", "parameters", "extra"]))] = draw(JUNK)
    return body


@st.composite
def http_request(draw, inputs: list[dict]) -> tuple[str, bytes, dict]:
    """(route, body bytes, headers)."""
    route = draw(st.sampled_from(ROUTES))
    doc = draw(infer_body(inputs) if route == "infer" else generate_body(inputs))
    kind = draw(st.integers(0, 9))
    if kind == 0:  # not JSON: bytes, mostly invalid UTF-8
        body = draw(st.binary(max_size=24))
    elif kind == 1:  # JSON, but not an object
        body = json.dumps(draw(JUNK)).encode()
    elif kind == 2:  # an invalid UTF-8 sequence inside a JSON string, or cut short
        raw = json.dumps(doc).encode()
        body = raw.replace(b'"', b'"\xff\xfe', 1) if draw(st.booleans()) else raw[:draw(st.integers(0, len(raw)))]
    else:
        body = json.dumps(doc).encode()
    headers = {"Content-Type": draw(st.sampled_from(["application/json", "application/json", "text/plain",
                                                     "application/octet-stream", "multipart/form-data", ""]))}
    if draw(st.integers(0, 9)) == 0:
        headers["Content-Encoding"] = draw(st.sampled_from(["gzip", "deflate", "br", "x-junk"]))
    if draw(st.integers(0, 9)) == 0:
        headers["Inference-Header-Content-Length"] = str(draw(st.integers(-5, 2 * len(body) + 5)))
    return route, body, {k: v for k, v in headers.items() if v}


_GRPC_BYTES = {"BOOL": 1, "UINT8": 1, "INT8": 1, "UINT16": 2, "INT16": 2, "FP16": 2, "BF16": 2, "UINT32": 4,
               "INT32": 4, "FP32": 4, "UINT64": 8, "INT64": 8, "FP64": 8}


@st.composite
def grpc_request(draw, inputs: list[dict]) -> tuple[bool, list[tuple[str, str, list[int]]], list[bytes]]:
    """(streamed, [(name, datatype, shape)], raw_input_contents): shapes, datatypes and byte counts that may not
    fit, BYTES elements whose length prefix lies."""
    tensors, raws = [], []
    for model in inputs:
        if not draw(st.integers(0, 3)):
            continue
        datatype = draw(st.one_of(st.just(model["datatype"]), st.sampled_from(DATATYPES), _text))
        shape = draw(st.one_of(st.just([d if d >= 0 else 1 for d in model["shape"]]),
                               st.lists(st.one_of(st.integers(0, 8), st.sampled_from([2**31, 2**32, 2**62])),
                                        max_size=3)))
        if model["datatype"] == "BYTES" and draw(st.booleans()):
            text = draw(st.binary(max_size=8))
            claimed = draw(st.one_of(st.just(len(text)), st.integers(0, 2**32 - 1)))
            raw = struct.pack("<I", claimed) + text
        else:
            raw = draw(st.binary(max_size=2 * _GRPC_BYTES.get(model["datatype"], 4)))
        tensors.append((draw(st.one_of(st.just(model["name"]), _text)), datatype, shape))
        raws.append(raw)
    if draw(st.integers(0, 5)) == 0:
        raws.append(draw(st.binary(max_size=8)))  # one raw content more than inputs
    return draw(st.booleans()), tensors, raws


# ------------------------------------------------------------------ sending and checking


def _auth(target: Target) -> dict:
    return {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}


def _send(url: str, body: bytes | None, headers: dict, method: str = "POST") -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def metadata(target: Target) -> list[dict]:
    """The entry model's inputs: name, datatype, shape (with the batch dimension), optional."""
    base = f"{target.http}/v2/models/{target.model}"
    meta = json.loads(_send(base, None, _auth(target), "GET")[1])
    config = json.loads(_send(f"{base}/config", None, _auth(target), "GET")[1])
    optional = {i["name"] for i in config.get("input", []) if i.get("optional")}
    return [{**i, "optional": i["name"] in optional} for i in meta["inputs"]]


def error_shape_ok(body: bytes) -> bool:
    """KServe's error: a JSON object with a string ``error``."""
    try:
        doc = json.loads(body)
    except ValueError:
        return False
    return isinstance(doc, dict) and isinstance(doc.get("error"), str)


def check_http(tally: Tally, route: str, status: int, body: bytes, sent: bytes) -> None:
    tally.saw(status)
    example = f"{route} {sent[:200]!r} -> {status} {body[:200]!r}"
    if status >= 500:
        text = json.loads(body).get("error", "") if error_shape_ok(body) else body[:60].decode("utf-8", "replace")
        # A class is the route, the status and what Triton says failed (its message up to the first colon).
        tally.broke(f"http {status} on {route}: {text.split(':')[0][:60]}", example)
    if status >= 400 and not error_shape_ok(body):
        tally.broke(f"error not in KServe's shape ({status} on {route})", example)


def check_grpc(tally: Tally, method: str, code: str, detail: str) -> None:
    tally.saw(f"grpc:{code}")
    if code in BAD_GRPC:
        tally.broke(f"grpc {code} on {method}: {detail.split(':')[0][:60]}", f"{method} -> {code} {detail[:300]}")


def _grpc_call(stub, pb, target: Target, streamed: bool, tensors, raws) -> tuple[str, str]:
    """(status name, detail) of one request; a stream's in-band error is "STREAM_ERROR" (the stream's status is OK)."""
    import grpc

    req = pb.ModelInferRequest(model_name=target.model)
    for name, datatype, shape in tensors:
        req.inputs.add(name=name, datatype=datatype, shape=shape)
    req.raw_input_contents.extend(raws)
    metadata_ = [("authorization", f"Bearer {target.api_key}")] if target.api_key else None
    try:
        if not streamed:
            stub.ModelInfer(req, timeout=TIMEOUT_S, metadata=metadata_)
            return "OK", ""
        # The first response tells: an error in the stream (Triton's way for ModelStreamInfer) or a result. A decoupled
        # model keeps the stream open after its last response unless asked otherwise, so no more is read.
        for resp in stub.ModelStreamInfer(iter([req]), timeout=TIMEOUT_S, metadata=metadata_):
            return ("STREAM_ERROR", resp.error_message) if resp.error_message else ("OK", "")
        return "OK", ""
    except grpc.RpcError as err:
        return err.code().name, err.details() or ""


def valid_request(inputs: list[dict]) -> dict:
    """A /generate_stream body of the required inputs with plain values (max_tokens-like integers are 1)."""
    plain = {"BYTES": "hi", "BOOL": False}
    return {i["name"]: plain.get(i["datatype"], 1.0 if i["datatype"].startswith(("FP", "BF")) else 1)
            for i in inputs if not i["optional"]}


def still_serves(target: Target, inputs: list[dict], tally: Tally) -> None:
    status, body = _send(f"{target.http}/v2/health/ready", None, _auth(target), "GET")
    if status != 200:
        tally.broke("not ready after the run", f"/v2/health/ready -> {status} {body[:200]!r}")
        return
    sent = json.dumps(valid_request(inputs)).encode()
    status, body = _send(f"{target.http}/v2/models/{target.model}/generate_stream", sent,
                         {"Content-Type": "application/json", **_auth(target)})
    events = [ln for ln in body.decode("utf-8", "replace").splitlines() if ln.startswith("data:")]
    if status != 200 or not events or any('"error"' in e for e in events):
        tally.broke("a valid request fails after the run", f"{sent!r} -> {status} {body[:300]!r}")


def run(target: Target, max_examples: int, seed: int) -> Tally:
    """Send ``max_examples`` generated HTTP requests and about a third as many gRPC ones to ``target``'s Triton
    routes; the Tally counts statuses and names each distinct invariant break once."""
    if not target.http or not target.model:
        raise ValueError("the triton surface needs target.http and target.model")
    tally = Tally(SURFACE)
    inputs = metadata(target)
    profile = settings(max_examples=max_examples, phases=[Phase.generate], database=None, deadline=None,
                       suppress_health_check=list(HealthCheck))

    @with_seed(seed)
    @profile
    @given(http_request(inputs))
    def http_case(case) -> None:
        route, body, headers = case
        url = f"{target.http}/v2/models/{target.model}/{route}"
        try:
            status, answer = _send(url, body, {**headers, **_auth(target)})
        except OSError as err:  # the connection broke: the worst answer of all
            tally.saw("no answer")
            tally.broke(f"no answer on {route}: {type(err).__name__}", f"{route} {body[:200]!r} -> {err}")
            return
        check_http(tally, route, status, answer, body)

    http_case()
    if target.grpc:
        import grpc
        from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc as svc

        channel = grpc.insecure_channel(target.grpc)
        stub = svc.GRPCInferenceServiceStub(channel)

        @with_seed(seed)
        @settings(profile, max_examples=max(1, max_examples // 3))
        @given(grpc_request(inputs))
        def grpc_case(case) -> None:
            streamed, tensors, raws = case
            code, detail = _grpc_call(stub, pb, target, streamed, tensors, raws)
            check_grpc(tally, "ModelStreamInfer" if streamed else "ModelInfer", code, detail)

        try:
            grpc_case()
        finally:
            channel.close()
    still_serves(target, inputs, tally)
    return tally
