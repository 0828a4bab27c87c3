"""stoker's OpenAI service as its own process, as in its container: `python -m stoker.openai_api` on a free port
in front of a Triton gRPC address, over a folder of the build's tokenizer files. Used by the tests and the
benchmarks that need the service apart from the test process (its memory, its own event loop)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from stoker.stack.services import free_port

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def openai_service(model: str, grpc_url: str, assets: Path, log: Path | None = None,
                   timeout_s: float = 60, extra_args: tuple[str, ...] = ()) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start the service and wait until /v1/models answers; yields (base URL ending in /v1, the process).
    ``extra_args``: more of its arguments (e.g. ``("--interface", "llmapi")``)."""
    port = free_port()
    out = open(log, "wb") if log else None
    try:
        service = subprocess.Popen(
            [sys.executable, "-m", "stoker.openai_api", "--model", model, "--grpc", grpc_url, "--assets", str(assets),
             "--port", str(port), "--log-level", "warning", *extra_args],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=out,
            stderr=subprocess.STDOUT if out else None)
    finally:
        if out:
            out.close()  # the child holds its own copy of the descriptor
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if service.poll() is not None:
                raise RuntimeError(f"the OpenAI service exited with {service.returncode}"
                                   + (f": {log.read_text()[-2000:]}" if log else ""))
            try:
                if httpx.get(f"{base}/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the OpenAI service did not answer within {timeout_s:.0f} s")
            time.sleep(0.2)
        yield base, service
    finally:
        service.terminate()
        service.wait(timeout=30)


# A chat template in the Hermes (Qwen2) family for the tiny Llama, which has none: written for these tests (data in
# that family's format: the tools inside <tools>, a call as <tool_call>{"name", "arguments"}</tool_call>, as vLLM's
# hermes tool parser reads it), so tool calls run end to end. Without tools it renders exactly what the service's
# fallback template does, BOS included (transformers renders with trim_blocks: the newline after a block is
# written as an expression).
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}system: you may call <tools>{% for t in tools %}{{ t.function | tojson }}"
    "{% endfor %}</tools> as <tool_call>{\"name\": …, \"arguments\": …}</tool_call>\n{% endif %}"
    "{% for m in messages %}{% if m.tool_calls %}{{ m.role }}: {% for c in m.tool_calls %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}{{ '\\n' }}"
    "{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@contextlib.contextmanager
def tiny_model_served(root: Path, model: str = "tiny",
                      chat_template: str | None = None) -> Iterator[tuple[object, Path, str]]:
    """The tiny Llama (seed 0) made under ``root``, served by a local tritonserver with this service in front:
    yields (the server, the build's artifact folder, the service's base URL). The benchmarks' common start.
    ``chat_template``: given to the build (its chat_template.jinja) before the service reads it."""
    from grpc_stream import serve_checkpoint

    from stoker.workers.tinymodel import make_tiny_model

    make_tiny_model(root / "ckpt", seed=0)
    with serve_checkpoint(root / "ckpt", root) as (server, artifact):
        if chat_template is not None:
            (artifact / "chat_template.jinja").write_text(chat_template)
        with openai_service(model, server.grpc_url, artifact) as (base, _service):
            yield server, artifact, base
