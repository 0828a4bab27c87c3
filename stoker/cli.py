"""The `stoker` command: short handlers over the library; every failure exits non-zero with one line."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .errors import StokerError
from .launch import print_summary, run_flow


def _plan(args) -> int:
    from .plan.compose import plan, render_plan
    from .run import RunContext
    from .spec.load import load_spec

    from .gpu import standin

    spec = load_spec(args.spec)
    print(f"spec {args.spec}: valid (digest {spec.digest()[:16]})")
    # The stand-in, decided as a run would decide it at its start (stoker/gpu/standin.py).
    print(render_plan(plan(spec, RunContext.new().model_copy(update={"standin": standin.decide(spec)}))))
    return 0


def _run(args) -> int:
    from .spec.load import load_spec

    spec = load_spec(args.spec)
    manifest, _ = run_flow(spec, force=args.force)
    print_summary(manifest)
    return 0


def _demo(args) -> int:
    from .demo import run_demo

    manifest, ui = run_demo()
    print_summary(manifest, ui)
    return 0


def _down(args) -> int:
    if args.name is not None:
        from .commands.down import handler

        return handler(args)
    from .demo import down  # no name: what `stoker demo` started, and only that

    for line in down():
        print(line)
    return 0


def _image(args) -> int:
    from .spec.schema import Deploy
    from .stack.image import DEFAULT_PROXY_IMAGE, ensure_image, ensure_proxy_image

    name = args.name or Deploy().image
    proxy_id = ensure_proxy_image(DEFAULT_PROXY_IMAGE, None, print, base=name)  # ensures `name` first
    print(f"image: {name} ({ensure_image(name, None, lambda _line: None)[:19]})")
    print(f"image: {DEFAULT_PROXY_IMAGE} ({proxy_id[:19]})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stoker", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("plan", help="validate a spec and show each step's cache key and hit/miss")
    s.add_argument("spec", type=Path)
    s.set_defaults(fn=_plan)
    s = sub.add_parser("run", help="run build_and_deploy for a spec")
    s.add_argument("spec", type=Path)
    s.add_argument("--force", action="store_true",
                   help="deploy even a build `stoker rollback` rolled back (this spec at the same model commit)")
    s.set_defaults(fn=_run)
    s = sub.add_parser("demo", help="the CPU reference demo on embedded defaults (local Hub mirror, S3, Docker)")
    s.set_defaults(fn=_demo)
    s = sub.add_parser("down", help="NAME: remove that deployment stoker started on this host (proxy, backends, "
                                    "OpenAI service, proxy state), nothing else; no NAME: stop what `stoker demo` "
                                    "started (only that)")
    s.add_argument("name", nargs="?", default=None, help="a deployment stoker started (`stoker status` lists them)")
    s.set_defaults(fn=_down)
    s = sub.add_parser("image", help="build the CPU Triton image and the HAProxy image if missing or out of date")
    s.add_argument("--name", default=None)
    s.set_defaults(fn=_image)
    import importlib

    from .commands import MODULES

    for name in MODULES:
        importlib.import_module(f".commands.{name}", __package__).register(sub)
    return p


# Prefect's background senders (events, API logs), named after their classes, drain at exit; one with items left
# logs "Still processing items: N items remaining..." through a logger with no handler, so Python's last-resort
# handler prints it after stoker's last line (seen: a `stoker rollback` refusal with PREFECT_API_URL set gave two
# lines). The items are still sent; only that progress line is dropped, never an error.
_PREFECT_DRAIN_LOGGERS = ("EventsWorker", "APILogWorker")


def main(argv: list[str] | None = None) -> int:
    import logging

    for name in _PREFECT_DRAIN_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    args = build_parser().parse_args(argv)
    if not os.environ.get("PREFECT_API_URL"):
        from .stack import prefect_home

        prefect_home.seed()  # the temporary API this process may start: a new home's database comes migrated
    try:
        return args.fn(args)
    except StokerError as err:
        print(f"stoker: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stoker: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - an unexpected fault still gets one line, not a trace
        if os.environ.get("STOKER_DEBUG"):
            raise
        first = (str(err).strip().splitlines() or [""])[0]
        print(f"stoker: error: {type(err).__name__}: {first} (STOKER_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
