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
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import logprobs as lp
from . import mapping as m
from . import choices, structured, tools, triton_stream
from .generation import Generating, LlmApiGenerating, Triton
from .served_model import LiveModel, ServedModel
from .sse import EventStream

DEFAULT_MAX_BODY_BYTES = 4 << 20
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
        authorization = m.authorization(request.headers.get("authorization"))
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
        m.authorization(request.headers.get("authorization"))  # before any work: it cannot reach the backend
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
        m.authorization(request.headers.get("authorization"))  # before any work: it cannot reach the backend
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
        return _event_stream(g, head, "text_completion", usage_on, [], lp.completion_chunker(head, usage_on, model))

    # Plain Starlette routes, not FastAPI's: they take the Request as it is, without FastAPI's dependency
    # resolution on the way in (tens of microseconds before the backend is asked, on every request).
    app.add_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_route("/v1/completions", completions, methods=["POST"])
    return app
