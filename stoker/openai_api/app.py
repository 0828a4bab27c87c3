"""The OpenAI-compatible ASGI service: /v1/models, /v1/completions, /v1/chat/completions.

One persistent gRPC channel to Triton (in a deployment: the proxy's gRPC frontend on a unix socket, so requests
follow a switch like any client's); each OpenAI request is one `stream_infer` stream to
`tensorrt_llm`, cancelled when the client goes away or a stop sequence matches. That model speaks the ensemble's
interface (token ids, ``Generating``) or the LLM API's (text, ``LlmApiGenerating``): the live build's, as
live.json names it, else the service's ``--interface``. The first Triton
response is awaited before the HTTP answer starts, so an unreachable backend is a 503 in OpenAI's
error shape rather than a broken stream; that response's text then leaves in the same write as the
headers (sse.py, http11.py).
"""

from __future__ import annotations

import dataclasses

import secrets
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from tritonclient.grpc import service_pb2, service_pb2_grpc

from . import logprobs as lp
from . import mapping as m
from . import choices, structured, tools, triton_stream
from .served_model import LiveModel, ServedModel
from .sse import EventStream

DEFAULT_MAX_BODY_BYTES = 4 << 20
MAX_MESSAGE_BYTES = 2**31 - 1
# Unavailable-ish gRPC codes: the proxy or the backend is not there (now); anything else is a server error.
_UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


class Triton:
    """One gRPC channel to Triton, opened in the serving event loop; one stream per generation."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._channel: grpc.aio.Channel | None = None
        self._stub: service_pb2_grpc.GRPCInferenceServiceStub | None = None

    def open(self) -> None:
        self._channel = grpc.aio.insecure_channel(self.url, options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_permit_without_calls", 1),
        ])
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    def stream(self, request: service_pb2.ModelInferRequest, authorization: str | None = None):
        """A started `ModelStreamInfer` call carrying ``request`` (iterate it; ``cancel()`` it).

        ``authorization``: the client's own header, passed on as gRPC metadata. The proxy checked it on the way
        in (deploy.api_keys) and checks it again on its gRPC port; this service holds no key of its own."""
        metadata = (("authorization", authorization),) if authorization else None
        return self._stub.ModelStreamInfer(iter([request]), metadata=metadata)

    async def outputs(self, model: str, authorization: str | None = None) -> frozenset[str]:
        """The outputs ``model`` declares (Triton's model metadata, through the proxy as a client would ask)."""
        metadata = (("authorization", authorization),) if authorization else None
        try:
            meta = await self._stub.ModelMetadata(service_pb2.ModelMetadataRequest(name=model), metadata=metadata)
        except grpc.aio.AioRpcError as err:
            raise _rpc_error(err, self.url) from None
        return frozenset(o.name for o in meta.outputs)


def _rpc_error(err: grpc.aio.AioRpcError, url: str) -> m.ApiError:
    detail = (err.details() or err.code().name).splitlines()[0]
    if err.code() in _UNAVAILABLE:
        return m.unavailable(f"the model backend at {url} is unavailable: {detail}")
    return m.backend_error(f"the model backend failed: {err.code().name}: {detail}")


class Generating:
    """One generation: the Triton stream, its token ids turned into text, the counts for ``usage``."""

    def __init__(self, triton: Triton, gen: triton_stream.Generation, model: ServedModel, request_id: str,
                 authorization: str | None = None) -> None:
        self.gen, self.triton, self.authorization = gen, triton, authorization
        self.text = triton_stream.TextStream(model.decode, gen.stop)
        self.completion_tokens = 0
        self.finish: str | None = None
        self.scored: list[lp.Scored] = []  # per counted token, when log probs are asked (gen.log_probs)
        self._taken = 0  # scored tokens already handed to a chunk (take_scored)
        self._request = triton_stream.triton_request(gen, request_id)
        self._call = None
        self._step: triton_stream.Step | None = None  # read, its tokens not yet turned into text

    async def open(self) -> None:
        """Start the stream and read its first response; Triton's or gRPC's refusal raises ApiError here."""
        self._call = self.triton.stream(self._request, self.authorization)
        try:
            self._step = await self._next()
        except BaseException:
            self.close()
            raise

    def _parse(self, resp) -> triton_stream.Step:
        return triton_stream.parse_response(resp)

    async def _next(self) -> triton_stream.Step:
        try:
            resp = await self._call.read()
        except grpc.aio.AioRpcError as err:
            raise _rpc_error(err, self.triton.url) from None
        if resp is grpc.aio.EOF:
            return triton_stream.Step((), True)
        step = self._parse(resp)
        if step.error and (refused := structured.refusal(step.error, self.gen.guide)) is not None:
            raise refused  # the backend would not compile the request's schema: the client's error, not ours
        if step.error:
            if "unknown model" in step.error or "not found" in step.error or "is not ready" in step.error:
                raise m.unavailable(f"the model backend is not ready: {step.error.splitlines()[0]}")
            raise m.backend_error(f"the model backend failed: {step.error.splitlines()[0]}")
        return step

    def ready(self) -> list[str]:
        """The text of the response already read, without waiting; ``finish`` is set if it was the last.

        The first response is read before the HTTP answer starts, so its text can leave with the headers.
        """
        step, self._step = self._step, None
        if step is None or self.finish is not None:
            return []
        out = []
        if self.gen.log_probs is not None and step.token_ids and len(step.log_probs or ()) != len(step.token_ids):
            raise m.backend_error(f"the model backend returned {len(step.log_probs or ())} log probs for "
                                  f"{len(step.token_ids)} tokens (output_log_probs)")
        for i, token in enumerate(step.token_ids):
            self.completion_tokens += 1
            if self.gen.log_probs is not None:
                self.scored.append(lp.Scored(token, step.log_probs[i], step.top[i] if step.top else ()))
            piece = self.text.push(token)
            if piece:
                out.append(piece)
            if self.text.stopped:
                break
        if self.text.stopped or step.final:
            rest = self.text.flush()
            if rest:
                out.append(rest)
            self.finish = triton_stream.finish_reason(self.text.stopped, self.completion_tokens, self.gen.max_tokens)
        return out

    def take_scored(self) -> list[lp.Scored] | None:
        """The scored tokens not yet handed on (None: log probs not asked for); each goes out once, in order."""
        if self.gen.log_probs is None:
            return None
        new, self._taken = self.scored[self._taken:], len(self.scored)
        return new

    async def pieces(self) -> AsyncIterator[str]:
        """Text as it is generated; ``finish`` and ``completion_tokens`` are set when it ends."""
        try:
            while True:
                for piece in self.ready():
                    yield piece
                if self.finish is not None:
                    return
                self._step = await self._next()
        finally:
            self.close()

    def close(self) -> None:
        """Cancel the stream unless it ended: the backend stops generating at its next token."""
        if self._call is not None and not self._call.done():
            self._call.cancel()


class LlmApiGenerating(Generating):
    """One generation by TensorRT-LLM's LLM-API model: the prompt goes as text, each response carries the whole
    output text so far (its new part is taken), the model says why it ended (finish_reason).

    ``completion_tokens`` is the returned text encoded with the build's tokenizer: the LLM API's model returns
    no token ids, only text."""

    def __init__(self, triton: Triton, gen: triton_stream.Generation, model: ServedModel, request_id: str,
                 authorization: str | None = None) -> None:
        self.gen, self.triton, self.authorization = gen, triton, authorization
        self.text = triton_stream.CumulativeText(gen.stop)
        self._count = lambda text: len(model.encode(text, add_special_tokens=False)) if text else 0
        self.completion_tokens = 0
        self.finish: str | None = None
        self.scored, self._taken = [], 0  # never asked: plan refuses log probs for the LLM API's model
        self._request = triton_stream.llmapi_request(gen, request_id)
        self._call = None
        self._step: triton_stream.Step | None = None

    def _parse(self, resp) -> triton_stream.Step:
        return triton_stream.parse_llmapi_response(resp)

    def ready(self) -> list[str]:
        step, self._step = self._step, None
        if step is None or self.finish is not None:
            return []
        out = []
        if step.text is not None:
            piece = self.text.push(step.text, final=step.final)
            if piece:
                out.append(piece)
        if self.text.stopped or step.final:
            rest = self.text.flush()
            if rest:
                out.append(rest)
            self.completion_tokens = self._count(self.text.sent)
            self.finish = triton_stream.llmapi_finish(step.finish, self.text.stopped, self.completion_tokens,
                                                      self.gen.max_tokens)
        return out


@dataclass
class Settings:
    model: str  # the name clients pass as ``model``: the deployment's name
    grpc_url: str
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # How to talk to `tensorrt_llm` when the live build does not say (live.json's "interface"): "ensemble" or
    # "llmapi" (triton_stream.INTERFACES).
    interface: str = triton_stream.ENSEMBLE


async def _body(request: Request, limit: int) -> bytes:
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) > limit:
        raise m.ApiError(413, f"The request body is {int(size)} bytes; this server accepts at most {limit}.",
                         "invalid_request_error", None, "request_too_large")
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise m.ApiError(413, f"The request body is over {limit} bytes, the most this server accepts.",
                             "invalid_request_error", None, "request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _usage_on(req: m.ChatRequest | m.CompletionRequest) -> bool:
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)


Chunk = Callable[[str | None, str | None, list[lp.Scored] | None], dict]


def _event_stream(g: Generating, head: m.Head, obj: str, usage_on: bool, opening: list[dict],
                  chunk: Chunk) -> EventStream:
    """A streamed answer, chat's or completions': the ``opening`` chunks, ``chunk(piece, None, scored)`` per piece
    of text, ``chunk(None, finish, scored)``, the usage chunk when asked for, ``[DONE]``; an error after the start
    is an error event. The text of the backend's first response (already read) goes out with the headers.
    ``scored``: the log probs of the tokens read since the previous chunk (None when not asked for), so each
    token's log prob goes out once, with the first text after it, or with the finish."""
    first = b"".join([*(m.sse(c) for c in opening), *(m.sse(chunk(p, None, g.take_scored())) for p in g.ready())])

    async def rest() -> AsyncGenerator[bytes, None]:
        try:
            async for piece in g.pieces():
                yield m.sse(chunk(piece, None, g.take_scored()))
            yield m.sse(chunk(None, g.finish, g.take_scored()))
            if usage_on:
                yield m.sse(m.usage_chunk(head, obj, m.usage(len(g.gen.input_ids), g.completion_tokens)))
        except m.ApiError as err:
            yield m.sse(err.body())
        finally:
            g.close()
        yield m.DONE

    return EventStream(first, rest())


async def _tool_answer(g: Generating, head: m.Head, req: m.ChatRequest, use: tools.ToolUse, template: str | None,
                       chat_logprobs: Callable) -> Response:
    """A chat answer that may hold tool calls (tools.parse). Streamed, text goes out as content once it cannot be
    part of a call, and a call goes out whole at the end (tools.Holding): its opening delta, then its arguments."""
    usage_on = _usage_on(req)
    if not req.stream:
        text = "".join([*g.ready(), *[p async for p in g.pieces()]])
        content, calls = tools.parse(text, use, template)
        body = m.chat_response(head, content, g.finish, m.usage(len(g.gen.input_ids), g.completion_tokens),
                               chat_logprobs(g.take_scored()))
        return JSONResponse(tools.attach(body, content, tools.tool_calls(calls, template)))
    holding = tools.Holding(use, template)

    def content(piece: str) -> bytes:
        out = holding.push(piece)
        return m.sse(m.chat_chunk(head, {"content": out}, None, usage_on)) if out else b""

    opening = m.sse(m.chat_chunk(head, {"role": "assistant", "content": ""}, None, usage_on))

    async def rest() -> AsyncGenerator[bytes, None]:
        try:
            async for piece in g.pieces():
                if sent := content(piece):
                    yield sent
            last, calls = holding.finish()
            calls_ = tools.tool_calls(calls, template)
            for delta in tools.deltas(last, calls_):
                yield m.sse(m.chat_chunk(head, delta, None, usage_on))
            # The log probs of every token go with the finish: the content chunks before it may lag the tokens.
            yield m.sse(m.chat_chunk(head, {}, "tool_calls" if calls_ else g.finish, usage_on,
                                     chat_logprobs(g.take_scored())))
            if usage_on:
                yield m.sse(m.usage_chunk(head, "chat.completion.chunk",
                                          m.usage(len(g.gen.input_ids), g.completion_tokens)))
        except m.ApiError as err:
            yield m.sse(err.body())
        finally:
            g.close()
        yield m.DONE

    return EventStream(opening + b"".join(content(p) for p in g.ready()), rest())


def create_app(settings: Settings, live: LiveModel) -> FastAPI:
    triton = Triton(settings.grpc_url)
    created = int(time.time())

    async def lifespan(_app: FastAPI):
        triton.open()
        yield
        await triton.close()

    app = FastAPI(title="stoker OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)

    @app.exception_handler(m.ApiError)
    async def _api_error(_request: Request, err: m.ApiError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        message = (f"Invalid URL ({request.method} {request.url.path})" if err.status_code in (404, 405)
                   else str(err.detail))
        code = "unknown_url" if err.status_code in (404, 405) else None
        return JSONResponse(m.ApiError(err.status_code, message, "invalid_request_error", None, code).body(),
                            status_code=err.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, err: Exception) -> JSONResponse:
        return JSONResponse(m.backend_error(f"internal error: {type(err).__name__}: {err}").body(), status_code=500)

    async def live_for(name: str) -> tuple[ServedModel, dict | None]:
        """The live build and the LoRA adapter a request's `model` names (None: the base); 404 in OpenAI's shape
        for any other name, also while no build can be read."""
        try:
            model = await live.get()
        except m.ApiError:
            if name != settings.model:
                raise m.unknown_model(name) from None
            raise
        if name == settings.model:
            return model, None
        if name in model.adapters:
            return model, model.adapters[name]
        raise m.unknown_model(name)

    async def cards() -> list[dict]:
        """The base, then each adapter of the live build with the base as its parent (as vLLM lists them)."""
        try:
            model = await live.get()
        except m.ApiError:
            return [m.model_card(settings.model, created, {})]
        return [m.model_card(settings.model, created, model.card()),
                *(m.model_card(name, created, {"parent": settings.model, "root": a.get("repo_id"),
                                               "revision": a.get("sha"), "lora_rank": a.get("r")})
                  for name, a in sorted(model.adapters.items()))]

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": await cards()}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict:
        found = next((c for c in await cards() if c["id"] == name), None)
        if found is None:
            raise m.unknown_model(name)
        return found

    def interface_of(model: ServedModel) -> str:
        return model.interface or settings.interface

    async def run(req: m.ChatRequest | m.CompletionRequest, gen: triton_stream.Generation, model: ServedModel,
                  prefix: str, request: Request, adapter: dict | None = None,
                  name: str | None = None) -> tuple[Generating, m.Head]:
        rid = f"{prefix}-{uuid.uuid4().hex}"
        if adapter is not None:
            gen = dataclasses.replace(gen, lora_task_id=int(adapter["task_id"]))
        head = m.Head(rid, int(time.time()), name or settings.model, model.fingerprint)
        kind = LlmApiGenerating if interface_of(model) == triton_stream.LLMAPI else Generating
        authorization = request.headers.get("authorization")
        if gen.log_probs:
            # Alternatives come only from a model that declares them (logprobs.py): asked per request rather than
            # remembered, since a switch may put another target's build behind the same tokenizer files.
            refused = lp.refusal(req, gen.log_probs, False,
                                 lp.TOP_OUTPUT in await triton.outputs(m.MODEL_NAME, authorization))
            if refused is not None:
                raise refused
        g = kind(triton, gen, model, rid, authorization)
        await g.open()
        return g, head

    async def chat(request: Request) -> Response:
        obj = m.parse_json(await _body(request, settings.max_body_bytes))
        req = m.parse_chat(obj)
        use = tools.parse_tools(obj)
        model, adapter = await live_for(req.model)
        interface = interface_of(model)
        guide = structured.guide_for(obj, llmapi=interface == triton_stream.LLMAPI)
        guide = tools.guide(use, guide, llmapi=interface == triton_stream.LLMAPI)
        if (refused := tools.template_refusal(use, model.chat_template)) is not None:
            raise refused
        messages, listed = tools.messages(req), use.template_tools() if use else None
        if interface == triton_stream.LLMAPI:
            # The model takes text and tokenizes it itself: the template rendered here, its tokens counted here.
            text = model.chat_prompt(messages, listed)
            ids = model.encode(text)
        else:
            text, ids = None, model.chat_ids(messages, listed)
        gen = triton_stream.plan(req, ids, model.context_len, seed=secrets.randbits(63), interface=interface,
                                 prompt_text=text, max_input_len=model.max_input_len)
        gen = dataclasses.replace(gen, guide=guide)
        if use is not None and use.active and (req.n or 1) > 1:
            raise m.bad_request(f"n = {req.n} with tools is not supported: a tool call is answered as one choice "
                                "(n = 1).", "n", "unsupported_value")
        # Penalties, logit_bias and a seed per choice (choices.py); n > 1 is answered there.
        gens = choices.generations(req, gen, model.vocab_size, interface)
        gen = gens[0]
        if len(gens) > 1:
            return await choices.chat(req, gens, lambda one: run(req, one, model, "chatcmpl", request, adapter,
                                                                 req.model), model)
        g, head = await run(req, gen, model, "chatcmpl", request, adapter, req.model)

        def chat_logprobs(scored: list[lp.Scored] | None) -> dict | None:
            return None if scored is None else lp.chat_logprobs(scored, model)

        if use is not None and use.active:
            return await _tool_answer(g, head, req, use, model.chat_template, chat_logprobs)
        if not req.stream:
            text = "".join([p async for p in g.pieces()])
            return JSONResponse(m.chat_response(head, text, g.finish,
                                                m.usage(len(gen.input_ids), g.completion_tokens),
                                                chat_logprobs(g.take_scored())))
        usage_on = _usage_on(req)
        return _event_stream(g, head, "chat.completion.chunk", usage_on, [
            m.chat_chunk(head, {"role": "assistant", "content": ""}, None, usage_on)],
            lambda piece, finish, scored: m.chat_chunk(head, {} if piece is None else {"content": piece}, finish,
                                                       usage_on, chat_logprobs(scored)))

    async def completions(request: Request) -> Response:
        obj = m.parse_json(await _body(request, settings.max_body_bytes))
        req = m.parse_completion(obj)
        model, adapter = await live_for(req.model)
        prompt = m.completion_prompt(req)
        interface = interface_of(model)
        guide = structured.guide_for(obj, llmapi=interface == triton_stream.LLMAPI)
        if interface == triton_stream.LLMAPI and not isinstance(prompt, str):
            raise m.bad_request("'prompt' as token ids is not supported by this deployment: it serves TensorRT-LLM's "
                                "LLM-API model (target: pytorch), which takes text. Send the prompt as text.",
                                "prompt", "unsupported_value")
        ids = model.encode(prompt) if isinstance(prompt, str) else prompt
        gen = triton_stream.plan(req, ids, model.context_len, seed=secrets.randbits(63),
                                 vocab_size=None if isinstance(prompt, str) else model.vocab_size,
                                 interface=interface, prompt_text=prompt if isinstance(prompt, str) else None,
                                 max_input_len=model.max_input_len)
        gen = dataclasses.replace(gen, guide=guide)
        # Penalties, logit_bias and a seed per choice (choices.py); n > 1 is answered there.
        gens = choices.generations(req, gen, model.vocab_size, interface)
        gen = gens[0]
        if len(gens) > 1:
            return await choices.completions(req, gens, lambda one: run(req, one, model, "cmpl", request, adapter,
                                                                        req.model), model)
        g, head = await run(req, gen, model, "cmpl", request, adapter, req.model)
        if not req.stream:
            text = "".join([p async for p in g.pieces()])
            scored = g.take_scored()
            return JSONResponse(m.completion_response(
                head, text, g.finish, m.usage(len(gen.input_ids), g.completion_tokens),
                None if scored is None else lp.completion_logprobs(scored, model)))
        usage_on = _usage_on(req)
        offset = 0  # text_offset runs on across chunks

        def chunk(piece: str | None, finish: str | None, scored: list[lp.Scored] | None) -> dict:
            nonlocal offset
            logprobs = None
            if scored is not None:
                logprobs = lp.completion_logprobs(scored, model, offset)
                offset += lp.text_length(scored, model)
            return m.completion_chunk(head, piece or "", finish, usage_on, logprobs)

        return _event_stream(g, head, "text_completion", usage_on, [], chunk)

    # Plain Starlette routes, not FastAPI's: they take the Request as it is, without FastAPI's dependency
    # resolution on the way in (tens of microseconds before the backend is asked, on every request).
    app.add_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_route("/v1/completions", completions, methods=["POST"])
    return app
