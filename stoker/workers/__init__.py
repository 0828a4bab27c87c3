"""Child-process CLIs for heavy work (torch, modelopt); the orchestrator runs them with stoker.orchestration.child."""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any, Callable

from ..errors import StokerError


def run_cli(work: Callable[[], dict[str, Any]]) -> int:
    """Run a worker's body: its result is one JSON line on stdout; a failure ends with a one-line cause.

    The parent shows a child's last line as the step's error, so that line must say what went wrong.
    """
    try:
        result = work()
    except StokerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - a child process must end with a one-line cause
        traceback.print_exc(file=sys.stderr)
        cause = str(exc).strip().splitlines()
        print(f"error: {type(exc).__name__}: {cause[0] if cause else ''}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0
