"""One generation against Triton: the gRPC channel (one per service, opened in its event loop), and a request's
`stream_infer` stream read into text, token counts, log probs and a finish reason: by the ensemble's interface
(token ids, ``Generating``) or the LLM API's (text, ``LlmApiGenerating``). The routes (app.py) decide what to ask
and shape the answers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from . import logprobs as lp
from . import mapping as m
from . import structured, triton_stream
from .served_model import ServedModel

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
