"""Property-based fuzzing of stoker's HTTP surfaces (issue 51): one module per surface, one interface.

Each surface module (``openai``, ``webhook``, ``triton``) exposes ``SURFACE`` (its name in fuzz.json) and
``run(target, max_examples, seed) -> Tally``: it generates requests with hypothesis from what the surface
accepts (the request models stoker defines, Triton's documented inputs), sends each to the real server at
``target``, and checks the invariants the issue sets: no 5xx but the documented ones, every error in the
surface's own shape, the server still up. The CI's bounded runs (tests/integration/test_fuzz_api.py,
test_fuzz_triton.py) and the longer run that writes benchmarks/results/fuzz.json (benchmarks/fuzz.py) call ``run``.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Target:
    """Where the surfaces of one running deployment answer. None: that surface is not running."""

    http: str | None = None  # the stable address's HTTP base, e.g. http://127.0.0.1:8000
    grpc: str | None = None  # the stable address's gRPC host:port
    openai: str | None = None  # the OpenAI service's base, e.g. http://127.0.0.1:8000/v1
    api_key: str | None = None  # a valid key where the deployment asks one
    webhook: str | None = None  # the webhook receiver's URL
    webhook_secret: str | None = None
    model: str | None = None  # the served model's name (OpenAI) / the Triton entry model


@dataclass
class Tally:
    """What one surface's run saw. ``failures``: distinct invariant breaks (a key naming the class) → one example."""

    surface: str
    generated: int = 0
    by_status: Counter = field(default_factory=Counter)
    failures: dict[str, str] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)

    def saw(self, status: int | str) -> None:
        self.generated += 1
        self.by_status[str(status)] += 1

    def broke(self, kind: str, example: str) -> None:
        self.failures.setdefault(kind, example[:500])

    def as_json(self) -> dict:
        server_errors = sum(n for s, n in self.by_status.items() if s.isdigit() and int(s) >= 500)
        return {"surface": self.surface, "generated_requests": self.generated,
                "by_status": dict(sorted(self.by_status.items())), "responses_5xx": server_errors,
                "distinct_failures": len(self.failures), "failures": self.failures,
                "seconds": round(time.monotonic() - self.started, 1)}
