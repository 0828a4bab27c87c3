"""`stoker webhook serve|sign`: the CI webhook receiver, and the signing a CI job does."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _serve(args) -> int:
    from ..webhook.app import ReceiverConfig, resolve_secret, serve
    from .deploy_checks import check_stack_specs
    from .deploy_flows import PREFECT_FILE

    # The receiver's specs deploy next to the watched ones: a shared port fails now, not after a build.
    check_stack_specs(PREFECT_FILE if PREFECT_FILE.exists() else None, args.specs)
    cfg = ReceiverConfig(secret=resolve_secret(args.secret_block), specs_dir=args.specs, deployment=args.deployment,
                         max_body_bytes=args.max_body, window_s=args.window, rate_per_s=args.rate, burst=args.burst)
    print(f"webhook: POST http://{args.host}:{args.port}/hooks/build → {cfg.deployment} (specs {cfg.specs_dir})")
    serve(cfg, args.host, args.port)
    return 0


def _sign(args) -> int:
    """Print the signed body and its header (for scripts without openssl)."""
    from ..webhook.app import resolve_secret
    from ..webhook.signing import SIGNATURE_HEADER, signed_body

    payload = {"spec": args.spec, "revision": args.revision}
    if args.repo:
        payload["repo"] = args.repo
    if args.idempotency_key:
        payload["idempotency_key"] = args.idempotency_key
    body, headers = signed_body(payload, resolve_secret(None))
    json.dump({"body": body.decode(), "header": f"{SIGNATURE_HEADER}: {headers[SIGNATURE_HEADER]}"}, sys.stdout)
    print()
    return 0


def register(sub) -> None:
    p = sub.add_parser("webhook", help="CI webhook receiver (signed triggers start build_and_deploy)")
    wsub = p.add_subparsers(dest="webhook_command", required=True)
    s = wsub.add_parser("serve", help="serve POST /hooks/build (secret: $STOKER_WEBHOOK_SECRET or --secret-block)")
    s.add_argument("--specs", type=Path, default=Path("deployments/specs"), help="folder of NAME.yaml specs")
    s.add_argument("--deployment", default="build_and_deploy/stoker-cpu")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8787)
    s.add_argument("--secret-block", default=None, help="name of a Prefect Secret block holding the secret")
    s.add_argument("--max-body", type=int, default=64 * 1024, help="bytes (413 above)")
    s.add_argument("--window", type=float, default=300.0, help="seconds a signed timestamp stays valid")
    s.add_argument("--rate", type=float, default=1.0, help="requests per second per client (429 above)")
    s.add_argument("--burst", type=int, default=10)
    s.set_defaults(fn=_serve)
    s = wsub.add_parser("sign", help="print a signed trigger body and header ($STOKER_WEBHOOK_SECRET)")
    s.add_argument("spec")
    s.add_argument("revision")
    s.add_argument("--repo", default=None)
    s.add_argument("--idempotency-key", default=None)
    s.set_defaults(fn=_sign)
