"""The receiver: an ASGI app (Starlette, already installed with Prefect) that starts flow runs.

Checks run cheapest first: size (413), rate (429), signature (401), JSON and
schema (400), replay window (401), idempotency (a repeat answers the first run),
then the spec named in the trigger is loaded, its revision set, and the
deployment run through ``run_deployment`` with Prefect's own idempotency key, so
receivers on several hosts still start one run per key. Answers 202 with the
flow run id. The secret is only ever compared, never logged or echoed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ..errors import StokerError
from . import signing

log = logging.getLogger("stoker.webhook")
SECRET_ENV = "STOKER_WEBHOOK_SECRET"
_SPEC_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


class WebhookConfigError(StokerError):
    """The receiver cannot start: no secret, no specs folder, ..."""


class Trigger(BaseModel):
    """The JSON a CI job posts (signed). ``timestamp`` is inside the signed bytes, so it cannot be altered."""

    model_config = ConfigDict(extra="forbid")
    spec: str = Field(pattern=_SPEC_NAME.pattern, description="name of a spec file in the receiver's specs folder")
    repo: str | None = Field(None, description="must equal the spec's model.repo_id when given")
    revision: str = Field(min_length=1, max_length=200, pattern=r"^\S+$")
    timestamp: int
    idempotency_key: str | None = Field(None, min_length=1, max_length=200)


@dataclass(frozen=True)
class ReceiverConfig:
    secret: bytes = field(repr=False)  # repr=False: never in logs or tracebacks
    specs_dir: Path
    deployment: str = "build_and_deploy/stoker-cpu"
    max_body_bytes: int = 64 * 1024
    window_s: float = 300.0
    rate_per_s: float = 1.0
    burst: int = 10

    def __post_init__(self) -> None:
        if not self.secret:
            raise WebhookConfigError("the webhook secret is empty")
        if not Path(self.specs_dir).is_dir():
            raise WebhookConfigError(f"specs folder {self.specs_dir} does not exist")


def resolve_secret(secret_block: str | None) -> bytes:
    """The shared secret: a Prefect Secret block when named, else $STOKER_WEBHOOK_SECRET; never empty."""
    if secret_block:
        from prefect.blocks.system import Secret

        try:
            value = Secret.load(secret_block).get()
        except ValueError as err:
            raise WebhookConfigError(f"Prefect Secret block {secret_block!r} not found") from err
    else:
        value = os.environ.get(SECRET_ENV, "")
    if not value:
        raise WebhookConfigError(f"no webhook secret: set ${SECRET_ENV} or pass --secret-block")
    return value.encode() if isinstance(value, str) else bytes(value)


# Starts the run; returns (flow run id, flow run name). Injected so the app is testable without Prefect.
StartRun = Callable[[str, dict, str], Awaitable[tuple[str, str]]]


async def prefect_start(deployment: str, parameters: dict, idempotency_key: str) -> tuple[str, str]:
    from prefect.deployments.flow_runs import arun_deployment

    run = await arun_deployment(deployment, parameters=parameters, timeout=0, idempotency_key=idempotency_key,
                                as_subflow=False, tags=["stoker", "webhook"])
    return str(run.id), run.name


def _error(status: int, message: str, **headers: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers or None)


def create_app(cfg: ReceiverConfig, start_run: StartRun = prefect_start,
               clock: Callable[[], float] = time.time) -> Starlette:
    bucket = signing.TokenBucket(cfg.rate_per_s, cfg.burst)
    # Twice the window: a key must outlive every body that could still pass the window check.
    seen = signing.SeenKeys(2 * cfg.window_s)

    async def read_capped(request: Request) -> bytes | None:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > cfg.max_body_bytes:
            return None
        body = b""
        async for chunk in request.stream():  # a lying or absent Content-Length is still capped
            body += chunk
            if len(body) > cfg.max_body_bytes:
                return None
        return body

    async def hook(request: Request) -> JSONResponse:
        t_received = clock()
        body = await read_capped(request)
        if body is None:
            return _error(413, f"body larger than {cfg.max_body_bytes} bytes")
        client = request.client.host if request.client else "?"
        if not bucket.allow(client, time.monotonic()):
            return _error(429, "rate limit exceeded", **{"Retry-After": str(max(1, int(1 / cfg.rate_per_s)))})
        if not signing.verify(cfg.secret, body, request.headers.get(signing.SIGNATURE_HEADER)):
            log.warning("webhook: refused a request with a bad or missing signature from %s", client)
            return _error(401, "bad or missing signature")
        try:
            trigger = Trigger.model_validate(json.loads(body))
        except (ValueError, ValidationError) as err:
            first = err.errors()[0] if isinstance(err, ValidationError) else None
            where = ".".join(str(p) for p in first["loc"]) + ": " + first["msg"] if first else str(err)
            return _error(400, f"invalid trigger: {where}")
        if not signing.within_window(trigger.timestamp, t_received, cfg.window_s):
            return _error(401, f"timestamp outside the {cfg.window_s:g} s window (replayed or clock skew)")
        digest = hashlib.sha256(body).hexdigest()
        key = trigger.idempotency_key or digest
        hit = seen.get(key, t_received)
        if hit is not None:
            if hit[0] != digest:
                return _error(400, "idempotency key already used for a different trigger")
            return JSONResponse({"flow_run_id": hit[1], "duplicate": True}, status_code=202)
        spec_path = Path(cfg.specs_dir) / f"{trigger.spec}.yaml"
        from ..spec import load_spec

        try:
            spec = load_spec(spec_path)
        except StokerError as err:
            return _error(400, f"spec {trigger.spec!r}: {err}")
        if trigger.repo and spec.model.repo_id != trigger.repo:
            return _error(400, f"repo {trigger.repo!r} is not the repo of spec {trigger.spec!r}")
        spec = spec.model_copy(update={"model": spec.model.model_copy(update={"revision": trigger.revision})})
        try:
            run_id, run_name = await start_run(cfg.deployment, {"spec": spec.model_dump(mode="json")},
                                               f"webhook:{key}")
        except Exception as err:  # noqa: BLE001 - Prefect unreachable or the deployment missing
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            log.error("webhook: could not start %s: %s", cfg.deployment, first)
            return _error(503, f"could not start {cfg.deployment}: {first}")
        seen.put(key, digest, run_id, t_received)
        log.info("webhook: spec %s revision %s → flow run %s (%s)", trigger.spec, trigger.revision, run_name, run_id)
        return JSONResponse({"flow_run_id": run_id, "flow_run_name": run_name, "duplicate": False,
                             "accept_s": round(clock() - t_received, 4)}, status_code=202)

    async def health(_request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    return Starlette(routes=[Route("/hooks/build", hook, methods=["POST"]), Route("/healthz", health)])


def serve(cfg: ReceiverConfig, host: str, port: int) -> None:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    uvicorn.run(create_app(cfg), host=host, port=port, log_level="info")
