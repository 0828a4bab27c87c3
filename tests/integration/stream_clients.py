"""Clients that stream through a stable endpoint and record every request, for benchmarks/operate.py and the
long-lived stream test: gRPC (a persistent channel, one stream per request), gRPC over one long-lived bidi stream
carrying request after request, and HTTP keep-alive SSE.

A record is (protocol, start, end, ok, truncated, error, tag): ok = every response arrived; truncated = the
answer stopped part-way (some responses, then the end or an error); tag = the build that answered.

The clients speak the served layout's interface (stoker/protocol.py): the ensemble's (``ensemble``: text_input,
max_tokens, one new piece per response) by default, or with ``STOKER_OPERATE_INTERFACE=llmapi`` the LLM API's
(``tensorrt_llm``: text_input, streaming, sampling_param_max_tokens, exclude_input_from_output, the whole text so
far in every response, the last one flagged final). Either way an answer is TOKENS responses.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import threading
import time
from pathlib import Path

TOKENS = 4
KEY_ENV = "STOKER_OPERATE_KEY"  # set by --keys; inherited by the load process
INTERFACE_ENV = "STOKER_OPERATE_INTERFACE"  # ensemble (default) or llmapi; inherited by the load process
# "1": the served model is a build of stoker's (the demo spec's, tests/integration/test_fleet.py): it batches
# (max_batch_size > 0), so gRPC inputs are [1, 1], and its ensemble declares an optional `stream` that defaults to
# false (one response with the whole answer), so every request sends stream=true. Otherwise: [1] and no flag (the
# scripted models of promotion_kit, max_batch_size 0, which always stream). Inherited by the load process.
BATCHED_ENV = "STOKER_OPERATE_BATCHED"
# Seconds a per-request client (gRPC, HTTP) waits after each answer; 0 (default): none. Inherited by the load process.
PACE_ENV = "STOKER_OPERATE_PACE_S"


def auth_headers() -> dict[str, str]:
    key = os.environ.get(KEY_ENV)
    return {"authorization": f"Bearer {key}"} if key else {}


def interface():
    from stoker.protocol import by_layout

    return by_layout(os.environ.get(INTERFACE_ENV) or "ensemble")


def request_values(max_tokens: int = TOKENS, text: str = "hi", http: bool = False, iface=None) -> tuple[str, dict]:
    """(model, {input: value}) of one streamed request in the served interface (``iface``, else the one
    STOKER_OPERATE_INTERFACE names); ``http``: the generate extension's JSON body, which always names the stream flag."""
    iface = iface or interface()
    values = {iface.text_input: text, iface.max_tokens: max_tokens, **dict(iface.always)}
    if iface.stream_always or http or os.environ.get(BATCHED_ENV) == "1":
        values[iface.stream] = True
    return iface.model, values


def grpc_inputs(module, max_tokens: int = TOKENS, iface=None) -> tuple[str, list]:
    """(model, [InferInput]) for tritonclient's grpc or grpc.aio ``module`` (its InferInput)."""
    import numpy as np

    model, values = request_values(max_tokens, iface=iface)
    inputs = []
    for name, value in values.items():
        kind, dtype = (("BYTES", np.object_) if isinstance(value, str) else ("BOOL", np.bool_)
                       if isinstance(value, bool) else ("INT32", np.int32))
        v = value.encode() if isinstance(value, str) else value
        if os.environ.get(BATCHED_ENV) == "1":  # a model with max_batch_size > 0 (the demo's): a batch of one
            t = module.InferInput(name, [1, 1], kind)
            t.set_data_from_numpy(np.array([[v]], dtype=dtype))
        else:
            t = module.InferInput(name, [1], kind)
            t.set_data_from_numpy(np.array([v], dtype=dtype))
        inputs.append(t)
    return model, inputs


def first_text(array) -> str:
    """The answer's text: ``text_output`` is [1] from a model without batching, [1, 1] from a batching one."""
    return array.reshape(-1)[0].decode()


def tag_of(text: str) -> str:
    """The build named by an answer's first response ("<tag>:0 ", cumulative or not)."""
    return text.split(":")[0]


def _grpc_client(url: str, stop, records: list, interval_s: float = 0.0) -> None:
    import tritonclient.grpc as grpcclient
    from tritonclient.grpc.aio import InferenceServerClient

    async def run() -> None:
        client = InferenceServerClient(url)
        while not stop.is_set():
            model, inputs = grpc_inputs(grpcclient)

            async def one():
                yield {"model_name": model, "inputs": inputs}

            t0, got, err = time.time(), [], None
            try:
                async for result, error in client.stream_infer(one(), headers=auth_headers() or None):
                    if error is not None:
                        raise error
                    got.append(first_text(result.as_numpy("text_output")))
                    if len(got) == TOKENS:
                        break
            except BaseException as exc:  # noqa: BLE001 - recorded (a cancelled call is CancelledError)
                err = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            records.append(("grpc", t0, time.time(), err is None and len(got) == TOKENS,
                            err is None and len(got) != TOKENS, err, tag_of(got[0]) if got else None))
            if err:
                await asyncio.sleep(0.05)  # a real client backs off a little after a failure
            elif interval_s or pace():
                await asyncio.sleep(interval_s or pace())
        await client.close()

    asyncio.run(run())


def _http_client(url: str, stop, records: list) -> None:
    import http.client

    host, port = url.removeprefix("http://").split(":")
    model, values = request_values(http=True)
    body = json.dumps(values)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    while not stop.is_set():
        t0, events, err = time.time(), [], None
        try:
            conn.request("POST", f"/v2/models/{model}/generate_stream", body,
                         {"Content-Type": "application/json", **auth_headers()})
            resp = conn.getresponse()
            raw = resp.read().decode()
            events = [json.loads(ln[5:]) for ln in raw.splitlines() if ln.startswith("data:")]
            bad = [e["error"] for e in events if "error" in e]
            if resp.status != 200 or bad:
                err = f"HTTP {resp.status}: {(bad or [raw[:120]])[0]}"
        except Exception as exc:  # noqa: BLE001 - recorded; reconnect like a real client
            err = f"{type(exc).__name__}: {exc}"
            conn.close()
            conn = http.client.HTTPConnection(host, int(port), timeout=30)
        tokens = [e.get("text_output", "") for e in events if "text_output" in e]
        records.append(("http", t0, time.time(), err is None and len(tokens) == TOKENS,
                        err is None and len(tokens) != TOKENS, err, tag_of(tokens[0]) if tokens else None))
        if err:
            time.sleep(0.05)  # a real client backs off a little after a failure
        elif pace():
            time.sleep(pace())


def pace() -> float:
    return float(os.environ.get(PACE_ENV) or 0)


def long_stream_client(url: str, stop, records: list, gap_s: float = 0.3, stats: dict | None = None,
                       protocol: str = "grpc-long") -> None:
    """One gRPC bidi stream carrying request after request, ``gap_s`` apart, as a chat front end keeps one open.

    What the README tells clients: a stream can end between requests (its backend was retired); open a new one
    and go on. A request whose stream ended before any response is recorded as failed (not truncated) and is
    not resent here, so the count stays honest. ``stats["reconnects"]`` counts the streams opened after the first.
    ``gap_s`` 0: a busy stream, request after request with no pause (tritonclient's streaming examples); its
    records are named ``protocol``.
    """
    import tritonclient.grpc as grpcclient

    stats = {} if stats is None else stats
    stats.setdefault("reconnects", 0)
    client = grpcclient.InferenceServerClient(url)
    answers: queue.Queue = queue.Queue()

    def open_stream() -> None:
        nonlocal answers
        answers = queue.Queue()
        mine = answers
        client.start_stream(callback=lambda result, error: mine.put((result, error)), headers=auth_headers() or None)

    def reopen() -> None:
        client.stop_stream()
        open_stream()
        stats["reconnects"] += 1

    open_stream()
    while not stop.is_set():
        ended = False
        while not answers.empty():  # the stream ended while idle: its error is waiting
            ended = ended or answers.get_nowait()[1] is not None
        if ended:
            reopen()
        model, inputs = grpc_inputs(grpcclient)
        t0, got, err = time.time(), [], None
        try:
            client.async_stream_infer(model, inputs, enable_empty_final_response=True)
            while True:
                result, error = answers.get(timeout=30)
                if error is not None:
                    err = f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
                    break
                text = result.as_numpy("text_output")  # the LLM API's last response carries text and the flag
                if text is not None:
                    got.append(first_text(text))
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
        except Exception as exc:  # noqa: BLE001 - recorded (queue.Empty: no answer in 30 s)
            err = f"{type(exc).__name__}: {exc}"
        records.append((protocol, t0, time.time(), err is None and len(got) == TOKENS,
                        (err is None and len(got) != TOKENS) or (err is not None and 0 < len(got)), err,
                        tag_of(got[0]) if got else None))
        if err:
            reopen()
        if gap_s:
            time.sleep(gap_s)
    client.stop_stream()
    client.close()


def load_process(endpoint: dict, stop, out_path: str, ready) -> None:
    """2 gRPC clients (a stream per request), 1 long-lived bidi stream (0.3 s between requests), 1 busy bidi stream
    (no pause), 2 HTTP SSE clients; writes {"records": [...], "long_stream": {"reconnects": N},
    "busy_stream": {"reconnects": N}} to ``out_path`` when ``stop`` is set."""
    records: list = []
    long_stats: dict = {}
    busy_stats: dict = {}
    threads = [threading.Thread(target=_grpc_client, args=(endpoint["grpc"], stop, records)) for _ in range(2)]
    threads.append(threading.Thread(target=long_stream_client, args=(endpoint["grpc"], stop, records, 0.3, long_stats)))
    threads.append(threading.Thread(target=long_stream_client, args=(endpoint["grpc"], stop, records, 0.0, busy_stats,
                                                                    "grpc-busy")))
    threads += [threading.Thread(target=_http_client, args=(endpoint["http"], stop, records)) for _ in range(2)]
    for t in threads:
        t.start()
    ready.set()
    for t in threads:
        t.join()
    Path(out_path).write_text(json.dumps({"records": records, "long_stream": long_stats, "busy_stream": busy_stats}))
