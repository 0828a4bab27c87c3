"""What a clean run may not print (issue 14: "a user reads ERROR as failure, and the run's own story drowns").

`noise(text)` returns the offending lines of a command's output: an ERROR, a traceback, any warning,
anything deprecated, and Triton's startup tables. test_flow.py runs it on a cold `stoker demo` and on the log of
the UI's rerun of the demo's spec; test_clean_logs.py checks that it catches each line a demo used to print.
"""

from __future__ import annotations

import re

_FORBIDDEN = (
    re.compile(r"ERROR"),  # Prefect's level name; "errors 0/16" (lower case) is a result, not a fault
    re.compile(r"Traceback"),
    re.compile(r"\b\w*(Error|Exception): "),  # an exception's last line, e.g. sqlite3.OperationalError: …
    re.compile(r"warning", re.IGNORECASE),  # Prefect's WARNING level, Python's UserWarning, "warnings.warn("
    re.compile(r"deprecated", re.IGNORECASE),
    re.compile(r"\[transformers\]"),  # transformers' own logger ("Token indices sequence length is longer …")
    re.compile(r"\[stoker-[\w.-]+\]\s*([EW]\d{4} |Error)"),  # a Triton error or warning streamed from a container
    # Triton's startup tables: their borders, and rows streamed from a container ("[stoker-x-blue] | …").
    re.compile(r"^\s*\+-{3,}"),
    re.compile(r"\[stoker-[\w.-]+\]\s*[|+]"),
    re.compile(r"\|\s*(server_id|server_version|model_repository_path|strict_readiness)\s*\|"),
)

# stoker's own warnings that a clean run may still print, because they are the user's business. Each
# needs its reason.
ALLOWED = (
    # The benchmark says so when the load generator, not the server, limited a level: on a loaded CI
    # machine this can happen to a clean run, and the user must know the numbers describe the client.
    re.compile(r"the client was saturated"),
)


def noise(text: str) -> list[str]:
    """The lines of `text` that a clean run must not print."""
    return [line for line in text.splitlines()
            if any(p.search(line) for p in _FORBIDDEN) and not any(a.search(line) for a in ALLOWED)]
