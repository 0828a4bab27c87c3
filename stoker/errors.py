"""The error tree every stoker module raises from.

`StokerError` messages are one line that names the cause, so the CLI can print
them as-is. `TransientError` marks failures worth retrying (a server that is
restarting, a dropped connection); everything else is bad input or a real
fault, and retrying it only wastes time.
"""


class StokerError(Exception):
    """A failure with a one-line, user-facing cause."""


class SpecError(StokerError):
    """The pipeline spec is invalid (names the offending field)."""


class PlanRefused(SpecError):
    """A spec that cannot work as written on its target; the message names the field and the fix."""


class TransientError(StokerError):
    """A failure that may succeed on retry (network blips, busy servers)."""


class StepError(StokerError):
    """A pipeline step failed for a non-transient reason."""


class ChildProcessFailed(StepError):
    """A heavy child process (quantize, build, ...) exited non-zero."""


def is_transient(exc: BaseException) -> bool:
    """True when retrying `exc` could help; used by every task's retry condition."""
    if isinstance(exc, TransientError):
        return True
    if isinstance(exc, StokerError):
        return False
    # Connection-level failures from the HTTP stacks we use (boto3/urllib3/requests/grpc).
    name = type(exc).__name__
    return name in {
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ConnectionClosedError",
        "ConnectionError",
        "ConnectionResetError",
        "ConnectionRefusedError",
    }


def one_line(exc: BaseException) -> str:
    """`Type: first line` of an exception: what a manifest, report or rollback record shows as the cause."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


class EvaluationFailed(StepError):
    """The candidate answers measurably worse than the unquantized build allows (names the metric)."""

    def __init__(self, message: str, detail: dict | None = None) -> None:
        super().__init__(message)
        self.detail = detail or {}  # the whole evaluation, for the manifest of the failed run
