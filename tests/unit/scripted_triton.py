"""A scripted stand-in for the OpenAI service's Triton channel (stoker/openai_api/generation.py `Triton`), for unit
tests of the service's routes in process: each stream answers what ``script(request)`` returns for that request.
Integration tests talk to the real tritonserver instead."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class ScriptedCall:
    """One stream: its responses in order, then EOF."""

    def __init__(self, responses) -> None:
        self.responses = list(responses)

    async def read(self):
        import grpc

        await asyncio.sleep(0)  # several streams interleave, as real ones do
        return self.responses.pop(0) if self.responses else grpc.aio.EOF

    def done(self) -> bool:
        return not self.responses

    def cancel(self) -> None:
        self.responses = []


def scripted_triton(script: Callable[[object], list], declared: frozenset[str]) -> type:
    """A class to put in place of `Triton`: records every request (``requests``), answers by ``script``, and
    declares ``declared`` as `tensorrt_llm`'s outputs (a test may swap either attribute)."""

    class ScriptedTriton:
        requests: list = []
        outputs_declared = declared

        def __init__(self, url: str) -> None:
            self.url = url

        def open(self) -> None: ...

        async def close(self) -> None: ...

        def stream(self, request, authorization=None) -> ScriptedCall:
            type(self).requests.append(request)
            return ScriptedCall(script(request))

        async def outputs(self, model: str, authorization=None) -> frozenset[str]:
            return type(self).outputs_declared

    return ScriptedTriton
