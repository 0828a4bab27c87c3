"""The receiver: an ASGI app (Starlette, already installed with Prefect) that starts flow runs.

Checks run cheapest first: size (413), rate (429), signature (401), JSON and
schema (400), replay window (401), idempotency against the keys this receiver
has seen (a key with the same trigger — spec, repo, revision — answers the first
run, 202 ``{"flow_run_id", "duplicate": true}``, whatever the timestamp, so a CI
re-run gets its build back; with another trigger, 409 naming that run; without a
key the key is the body's sha256, so only a byte-identical resend is a repeat),
then the spec named in the trigger is loaded (400), the stack must hold its
credentials block (400) and the deployment's pool an online worker (503), its
revision set, and the deployment run through ``run_deployment`` with Prefect's
own idempotency key ``webhook:<key>``, so receivers on several hosts, or a
restarted one, still start one run per key: a run Prefect found instead of
creating is checked against the trigger by its ``stoker-trigger:`` tag, with the
same two answers. A new run answers 202 with its id and ``"duplicate": false``.
The secret is only ever compared, never logged or echoed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ..errors import StokerError
from ..spec.named import SPEC_NAME
from . import signing

log = logging.getLogger("stoker.webhook")
SECRET_ENV = "STOKER_WEBHOOK_SECRET"
_SPEC_NAME = re.compile(SPEC_NAME)


class WebhookConfigError(StokerError):
    """The receiver cannot start: no secret, no specs folder, ..."""


class Trigger(BaseModel):
    """The JSON a CI job posts (signed). ``timestamp`` is inside the signed bytes, so it cannot be altered."""

    model_config = ConfigDict(extra="forbid")
    spec: str = Field(pattern=_SPEC_NAME.pattern, description="name of a spec file in the receiver's specs folder")
    repo: str | None = Field(None, description="must equal the spec's model.repo_id when given")
    revision: str = Field(min_length=1, max_length=200, pattern=r"^\S+$")
    # A Unix time in seconds as an int64 holds it: beyond a float's range the window check would overflow (a 500).
    timestamp: int = Field(ge=-(2**63), lt=2**63)
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


TRIGGER_TAG = "stoker-trigger:"


def trigger_identity(trigger: Trigger) -> str:
    """What a repeated key must match to be the same trigger: spec, repo and revision (not the timestamp)."""
    canonical = json.dumps([trigger.spec, trigger.repo, trigger.revision], separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Started:
    """A flow run for an idempotency key: created by this call, or found (and then whose trigger it was)."""

    run_id: str
    run_name: str
    created: bool
    identity: str | None  # from the run's stoker-trigger tag; None when the run has none
    revision: str | None = None  # the revision the run builds, to name it in a 409


class Refused(StokerError):
    """The stack cannot run this trigger now (a missing credentials block, no worker): an HTTP status + one line."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# Starts (or finds) the run for an idempotency key. Injected so the app is testable without Prefect.
StartRun = Callable[[str, dict, str, str], Awaitable[Started]]
# Raises Refused when the stack lacks what the spec's run needs. Injected for the same reason.
CheckRun = Callable[[object, str], Awaitable[None]]


async def prefect_start(deployment: str, parameters: dict, idempotency_key: str, identity: str) -> Started:
    from prefect.deployments.flow_runs import arun_deployment

    # A name of our own tells a run this call created from one Prefect found under the key (as the watcher does).
    name = f"webhook-{uuid.uuid4().hex[:10]}"
    run = await arun_deployment(deployment, parameters=parameters, timeout=0, idempotency_key=idempotency_key,
                                flow_run_name=name, as_subflow=False,
                                tags=["stoker", "webhook", f"{TRIGGER_TAG}{identity}"])
    # Read back from the run, not taken from the request: a found run is another request's.
    found = next((t[len(TRIGGER_TAG):] for t in run.tags or [] if t.startswith(TRIGGER_TAG)), None)
    revision = (((run.parameters or {}).get("spec") or {}).get("model") or {}).get("revision")
    return Started(str(run.id), run.name, run.name == name, found, revision)


async def prefect_check(spec, deployment: str) -> None:
    """The spec's credentials block exists on this Prefect API, and the deployment's pool has an online worker."""
    import anyio

    from ..storage.credentials import CredentialsError, aws_keys
    from ..orchestration.routing import RoutingError, check_route

    def check() -> None:  # Prefect's sync clients: off the event loop
        try:
            aws_keys(spec.storage)
        except CredentialsError as err:
            raise Refused(400, str(err)) from None
        try:
            check_route(deployment, what="webhook")
        except RoutingError as err:
            raise Refused(503, str(err)) from None

    await anyio.to_thread.run_sync(check)


def _error(status: int, message: str, **headers: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers or None)


def _repeat(key: str, trigger: Trigger, identity: str, first: Started) -> JSONResponse:
    """A key seen before: the first run when the trigger is the same, else 409 naming that run."""
    # A run without the tag (started before receivers tagged runs) cannot be told apart: the key decides.
    if first.identity is not None and first.identity != identity:
        built = f" (revision {first.revision!r})" if first.revision else ""
        return _error(409, f"idempotency key {key!r} already started flow run {first.run_id}{built} for another "
                           f"trigger; this request: spec {trigger.spec!r} repo {trigger.repo!r} "
                           f"revision {trigger.revision!r}")
    return JSONResponse({"flow_run_id": first.run_id, "duplicate": True}, status_code=202)


def create_app(cfg: ReceiverConfig, start_run: StartRun = prefect_start, check_run: CheckRun = prefect_check,
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
        # RecursionError: nesting deeper than the parser's stack is malformed input, not a server fault.
        except (ValueError, ValidationError, RecursionError) as err:
            first = err.errors()[0] if isinstance(err, ValidationError) else None
            where = (".".join(str(p) for p in first["loc"]) + ": " + first["msg"] if first
                     else "nested too deep" if isinstance(err, RecursionError) else str(err))
            return _error(400, f"invalid trigger: {where}")
        if not signing.within_window(trigger.timestamp, t_received, cfg.window_s):
            return _error(401, f"timestamp outside the {cfg.window_s:g} s window (replayed or clock skew)")
        identity = trigger_identity(trigger)
        # Without a key only a byte-identical resend is a repeat; with one, the same trigger is, whatever its time.
        key = trigger.idempotency_key or hashlib.sha256(body).hexdigest()
        hit = seen.get(key, t_received)
        if hit is not None:
            return _repeat(key, trigger, identity, hit)
        from ..spec.named import load_named

        try:
            spec = load_named(Path(cfg.specs_dir), trigger.spec, trigger.revision, trigger.repo)
        except StokerError as err:
            return _error(400, str(err))
        try:
            await check_run(spec, cfg.deployment)
            started = await start_run(cfg.deployment, {"spec": spec.model_dump(mode="json")}, f"webhook:{key}",
                                      identity)
        except Refused as err:
            log.warning("webhook: refused spec %s: %s", trigger.spec, err)
            return _error(err.status, f"spec {trigger.spec!r}: {err}")
        except Exception as err:  # noqa: BLE001 - Prefect unreachable or the deployment missing
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            log.error("webhook: could not start %s: %s", cfg.deployment, first)
            return _error(503, f"could not start {cfg.deployment}: {first}")
        if started.created:  # this trigger's run, whatever the starter could read back from it
            started = replace(started, identity=identity, revision=trigger.revision)
        seen.put(key, started, t_received)
        if not started.created:  # Prefect had a run under this key: another receiver's, or ours before a restart
            return _repeat(key, trigger, identity, started)
        log.info("webhook: spec %s revision %s → flow run %s (%s)", trigger.spec, trigger.revision, started.run_name,
                 started.run_id)
        return JSONResponse({"flow_run_id": started.run_id, "flow_run_name": started.run_name, "duplicate": False,
                             "accept_s": round(clock() - t_received, 4)}, status_code=202)

    async def health(_request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    async def not_here(request: Request, err: HTTPException) -> JSONResponse:
        """Starlette's own 404 and 405 are plain text: answered in the receiver's shape, as every other error."""
        message = (f"not found: {request.url.path} (this receiver serves POST /hooks/build and GET /healthz)"
                   if err.status_code == 404
                   else f"method {request.method} not allowed for {request.url.path}")
        return _error(err.status_code, message, **(err.headers or {}))

    return Starlette(routes=[Route("/hooks/build", hook, methods=["POST"]), Route("/healthz", health)],
                     exception_handlers={HTTPException: not_here})


def serve(cfg: ReceiverConfig, host: str, port: int, tls: tuple[Path, Path] | None = None) -> None:
    """Serve until stopped; HTTPS with ``tls`` (certificate, key: PEM files)."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    files = {"ssl_certfile": str(tls[0]), "ssl_keyfile": str(tls[1])} if tls else {}
    uvicorn.run(create_app(cfg), host=host, port=port, log_level="info", **files)
