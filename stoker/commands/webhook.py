"""`stoker webhook serve|sign`: the CI webhook receiver, and the signing a CI job does."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def _serve(args) -> int:
    from ..webhook.app import ReceiverConfig, resolve_secret, serve
    from .deploy_checks import check_stack_specs
    from .deploy_flows import PREFECT_FILE

    tls = check_tls(args.host, args.tls_cert, args.tls_key, args.plain_http)
    # The receiver's specs deploy next to the watched ones: a shared port fails now, not after a build.
    check_stack_specs(PREFECT_FILE if PREFECT_FILE.exists() else None, args.specs)
    cfg = ReceiverConfig(secret=resolve_secret(args.secret_block), specs_dir=args.specs, deployment=args.deployment,
                         max_body_bytes=args.max_body, window_s=args.window, rate_per_s=args.rate, burst=args.burst)
    scheme = "https" if tls else "http"
    print(f"webhook: POST {scheme}://{args.host}:{args.port}/hooks/build → {cfg.deployment} (specs {cfg.specs_dir})")
    serve(cfg, args.host, args.port, tls)
    return 0


def check_tls(host: str, cert: Path | None, key: Path | None, plain_http: bool) -> tuple[Path, Path] | None:
    """The certificate and key to serve with (None: plain HTTP); StokerError (one line) before anything starts."""
    import ipaddress

    from ..errors import StokerError

    if (cert is None) != (key is None):
        raise StokerError("webhook serve: give --tls-cert and --tls-key together (PEM files)")
    for flag, path in (("--tls-cert", cert), ("--tls-key", key)):
        if path is not None and not (path.is_file() and os.access(path, os.R_OK)):
            raise StokerError(f"webhook serve: {flag} {path}: not a readable file")
    if cert is not None:
        return cert, key
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not plain_http:
        # The body is signed, not secret: a trigger names specs and revisions, and plain HTTP shows them to the path.
        raise StokerError(f"webhook serve: --host {host} is not loopback: serve TLS (--tls-cert/--tls-key), or pass "
                          "--plain-http when a TLS-terminating proxy in front of it is the only way in")
    return None


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
    s.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate: serve HTTPS (with --tls-key)")
    s.add_argument("--tls-key", type=Path, default=None, help="PEM private key of --tls-cert")
    s.add_argument("--plain-http", action="store_true",
                   help="serve plain HTTP on a non-loopback --host (only behind a TLS-terminating proxy)")
    s.set_defaults(fn=_serve)
    s = wsub.add_parser("sign", help="print a signed trigger body and header ($STOKER_WEBHOOK_SECRET)")
    s.add_argument("spec")
    s.add_argument("revision")
    s.add_argument("--repo", default=None)
    s.add_argument("--idempotency-key", default=None)
    s.set_defaults(fn=_sign)
