"""The benchmark's error tree: every message is one line that names the cause."""

from __future__ import annotations

from ..errors import StepError, StokerError


class BenchmarkError(StokerError):
    """A benchmark could not run; the message is one line saying why."""


class InvalidBenchmarkConfig(BenchmarkError, ValueError):
    """Arguments that cannot produce a measurement (no requests, no prompts, a bad prompt file, ...)."""


class EndpointUnreachable(BenchmarkError):
    """No live Triton server answers at the URL."""


class ModelUnavailable(BenchmarkError):
    """The model is not in the repository, not ready, or lacks the LLM ensemble's inputs/outputs."""


class StreamingUnsupported(BenchmarkError):
    """The model cannot answer a streaming (decoupled) request."""


class OutputLengthUnsupported(BenchmarkError):
    """The model cannot produce the requested output length (its sequence limit is lower)."""


class GateFailed(StepError):
    """The benchmark regressed past the spec's thresholds against the promoted baseline."""

    def __init__(self, message: str, table: str) -> None:
        super().__init__(message)
        self.table = table  # markdown: what regressed, for the run's artifacts
