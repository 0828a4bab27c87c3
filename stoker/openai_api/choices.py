"""OpenAI's ``n``: one request, n choices, each its own Triton stream.

Each choice is a generation of its own (app.Generating over its own `stream_infer` stream), so the backend sees n
sequences and its in-flight batcher decodes them together, as it would n clients' requests. Choice i samples with
seed + i: the request's seed when it has one, so ``seed`` reproduces every choice, else the fresh random seed the
service drew. Greedy choices are therefore all equal, as OpenAI's are. ``mapping.MAX_CHOICES`` bounds n.

Answers: a body whose ``choices`` hold the n choices, index 0..n-1, each with its own finish_reason and log probs,
and ``usage.completion_tokens`` the sum of theirs (the prompt counted once); or a stream whose chunks carry one
choice each, by ``index``, in the order their text comes (the official clients assemble them by index), every
choice's finish in a chunk of its own, then the usage chunk when asked for, then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from fastapi.responses import JSONResponse

from . import logprobs as lp
from . import mapping as m
from . import sampling, triton_stream
from .sse import EventStream

Start = Callable[[triton_stream.Generation], Awaitable[tuple[Any, m.Head]]]  # app's run: (Generating, Head)
Chunk = Callable[[str | None, str | None, list[lp.Scored] | None], dict]


def generations(req: m._Request, gen: triton_stream.Generation, vocab_size: int | None,
                interface: str) -> list[triton_stream.Generation]:
    """The request's generation with its penalties and bias (sampling.py), once per choice, seed + index each."""
    gen = dataclasses.replace(gen, **sampling.fields(req, vocab_size, llmapi=interface == triton_stream.LLMAPI))
    return [dataclasses.replace(gen, seed=(gen.seed + i) & m.UINT64_MASK) for i in range(req.n or 1)]


async def open_all(gens: list[triton_stream.Generation], start: Start) -> tuple[list[Any], m.Head]:
    """Start every choice's stream (each read up to its first response); one refused closes the others. The first
    choice's head (id, created) stands for the answer."""
    results = await asyncio.gather(*(start(g) for g in gens), return_exceptions=True)
    failed = next((r for r in results if isinstance(r, BaseException)), None)
    if failed is not None:
        for r in results:
            if not isinstance(r, BaseException):
                r[0].close()
        raise failed
    return [g for g, _ in results], results[0][1]


def _indexed(chunk: dict, index: int) -> dict:
    for choice in chunk["choices"]:
        choice["index"] = index
    return chunk


def _usage(gs: list[Any]) -> dict:
    return m.usage(len(gs[0].gen.input_ids), sum(g.completion_tokens for g in gs))


async def _texts(gs: list[Any]) -> list[str]:
    async def whole(g) -> str:
        return "".join([p async for p in g.pieces()])

    tasks = [asyncio.ensure_future(whole(g)) for g in gs]
    try:
        # The first failure ends the answer: the other choices' streams are cancelled, not run to their end.
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()
        for g in gs:
            g.close()
    failed = next((t.exception() for t in tasks if t in done and t.exception() is not None), None)
    if failed is not None:
        raise failed
    return [t.result() for t in tasks]


def _usage_on(req: m._Request) -> bool:
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)


def _event_stream(gs: list[Any], head: m.Head, obj: str, usage_on: bool, opening: Callable[[], list[dict]],
                  chunk_for: Callable[[], Chunk]) -> EventStream:
    """app._event_stream for n choices: each choice's opening chunks and the text already read leave with the
    headers; then the choices' pieces as they come, each in a chunk carrying its index and the log probs of the
    tokens it read since its previous chunk."""
    chunks = [chunk_for() for _ in gs]
    first = b"".join(m.sse(_indexed(c, i)) for i, g in enumerate(gs) for c in
                     [*opening(), *(chunks[i](p, None, g.take_scored()) for p in g.ready())])
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, g) -> None:
        try:
            async for piece in g.pieces():
                # Taken here, while the choice's stream waits at this piece, so its log probs go with its text.
                await queue.put((i, piece, g.take_scored()))
            await queue.put((i, None, g.take_scored()))
        except Exception as err:  # noqa: BLE001 -- handed to the reader, which ends the stream with it
            await queue.put((i, err, None))

    async def rest() -> AsyncGenerator[bytes, None]:
        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gs)]
        try:
            left = len(gs)
            while left:
                i, item, scored = await queue.get()
                if isinstance(item, Exception):
                    raise item  # an ApiError becomes the error event below, as in app._event_stream
                if item is None:
                    left -= 1
                    yield m.sse(_indexed(chunks[i](None, gs[i].finish, scored), i))
                else:
                    yield m.sse(_indexed(chunks[i](item, None, scored), i))
            if usage_on:
                yield m.sse(m.usage_chunk(head, obj, _usage(gs)))
        except m.ApiError as err:
            yield m.sse(err.body())
        finally:
            for task in tasks:
                task.cancel()
            for g in gs:
                g.close()
        yield m.DONE

    return EventStream(first, rest())


async def chat(req: m.ChatRequest, gens: list[triton_stream.Generation], start: Start, model: Any):
    """The answer to a chat request with n > 1 (app.chat's, per choice)."""
    gs, head = await open_all(gens, start)

    def logprobs(scored: list[lp.Scored] | None) -> dict | None:
        return None if scored is None else lp.chat_logprobs(scored, model)

    if not req.stream:
        texts = await _texts(gs)
        use = _usage(gs)
        body = m.chat_response(head, texts[0], gs[0].finish, use)
        body["choices"] = [_indexed(m.chat_response(head, t, g.finish, use, logprobs(g.take_scored())), i)["choices"][0]
                           for i, (t, g) in enumerate(zip(texts, gs))]
        return JSONResponse(body)
    usage_on = _usage_on(req)
    return _event_stream(
        gs, head, "chat.completion.chunk", usage_on,
        lambda: [m.chat_chunk(head, {"role": "assistant", "content": ""}, None, usage_on)],
        lambda: lambda piece, finish, scored: m.chat_chunk(head, {} if piece is None else {"content": piece}, finish,
                                                          usage_on, logprobs(scored)))


async def completions(req: m.CompletionRequest, gens: list[triton_stream.Generation], start: Start, model: Any):
    """The answer to a completions request with n > 1 (app.completions', per choice)."""
    gs, head = await open_all(gens, start)
    if not req.stream:
        texts = await _texts(gs)
        use = _usage(gs)
        body = m.completion_response(head, texts[0], gs[0].finish, use)
        choices = []
        for i, (t, g) in enumerate(zip(texts, gs)):
            scored = g.take_scored()
            one = m.completion_response(head, t, g.finish, use,
                                        None if scored is None else lp.completion_logprobs(scored, model))
            choices.append(_indexed(one, i)["choices"][0])
        body["choices"] = choices
        return JSONResponse(body)
    usage_on = _usage_on(req)

    return _event_stream(gs, head, "text_completion", usage_on, lambda: [],
                         lambda: lp.completion_chunker(head, usage_on, model))
