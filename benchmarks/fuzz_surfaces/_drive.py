"""What the surface modules share: running a hypothesis strategy of cases for a budget, and the canary client.

A case is sent and checked by the surface's own ``check(case) -> status``; an invariant break is recorded on the
Tally (``broke``), never raised, so one run reports every distinct failure instead of stopping (and shrinking) at
the first. The canary is another client of the same server, asking one valid request at a steady pace while the
fuzzer runs: the issue's "serving of other clients unaffected", measured rather than assumed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, Phase, given, seed as hseed, settings
from hypothesis import strategies as st

from . import Tally


def drive(strategy: st.SearchStrategy, check: Callable[[Any], None], max_examples: int, seed: int) -> None:
    """Call ``check`` on ``max_examples`` cases drawn from ``strategy``, reproducibly for one ``seed``."""

    @hseed(seed)
    @settings(max_examples=max_examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), derandomize=False)
    @given(strategy)
    def one(case) -> None:
        check(case)

    one()


class Canary:
    """A valid request every ``every_s`` seconds in a thread; each that is not answered right is a failure."""

    def __init__(self, tally: Tally, ask: Callable[[], str | None], every_s: float = 1.0) -> None:
        self.tally, self.ask, self.every_s = tally, ask, every_s
        self.asked = self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.asked += 1
            try:
                problem = self.ask()
            except Exception as err:  # noqa: BLE001 - any failure of another client is what is counted
                problem = f"{type(err).__name__}: {err}"
            if problem:
                self.failed += 1
                self.tally.broke("canary: a valid request from another client failed", problem)

    def __enter__(self) -> Canary:
        self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

