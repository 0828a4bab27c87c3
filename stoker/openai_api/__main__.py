"""``python -m stoker_openai --model NAME --grpc HOST:PORT (--state DIR | --assets DIR) (--uds PATH | --port N)
[--interface ensemble|llmapi]``.

In a deployment's container: ``--state`` is the service's state folder (live.json, the builds'
tokenizer files) and ``--uds`` the unix socket the proxy forwards /v1/ to. ``--interface``: how Triton's
`tensorrt_llm` is spoken to (the ensemble's token ids, or TensorRT-LLM's LLM-API model's text) where live.json
does not name the live build's.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import uvicorn

from .access_log import AccessLog
from .app import DEFAULT_MAX_BODY_BYTES, Settings, create_app
from .http11 import H11HeadersWithFirstChunk
from .served_model import LiveModel
from .triton_stream import ENSEMBLE, INTERFACES

# Longer than the proxy keeps an idle connection to us, so the proxy never reuses one we are closing.
KEEP_ALIVE_S = 75


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="stoker_openai", description=__doc__)
    p.add_argument("--model", required=True, help="the model name clients use (the deployment's name)")
    p.add_argument("--grpc", required=True, help="Triton's gRPC address, HOST:PORT")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--state", type=Path, help="folder with live.json (followed across switches)")
    src.add_argument("--assets", type=Path, help="a fixed folder with the build's tokenizer files")
    p.add_argument("--uds", help="listen on this unix socket")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--interface", choices=INTERFACES, default=ENSEMBLE,
                   help="the backend's interface where live.json names none (default: %(default)s)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    live = LiveModel(folder=args.assets) if args.assets else LiveModel(state=args.state)
    app = create_app(Settings(args.model, args.grpc, args.max_body_bytes, args.interface), live)
    app = AccessLog(app)  # one line per request: method, path, status, ms (access_log.py; uvicorn's is off)
    where = {"uds": args.uds} if args.uds else {"host": args.host, "port": args.port}
    logging.getLogger("stoker_openai").info("serving %s at %s, Triton at %s (%s interface unless live.json says)",
                                            args.model, where, args.grpc, args.interface)
    # uvicorn's own h11 protocol (the image has no httptools), writing a stream's headers with its first chunk.
    uvicorn.run(app, **where, log_level=args.log_level, access_log=False, timeout_keep_alive=KEEP_ALIVE_S,
                http=H11HeadersWithFirstChunk)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
