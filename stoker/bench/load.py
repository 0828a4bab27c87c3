"""Load generation: fixed concurrency or request rate, by count or duration, in one or several processes.

- concurrency: `c` workers each keep one request in flight (closed loop, GenAI-Perf's concurrency mode).
- rate: requests start on an arrival schedule, Poisson (exponential gaps) or constant, whatever is in flight;
  an optional concurrency caps what may be in flight.
A level ends after `requests` requests, or when `duration_s` has passed (no new request starts after
it; those in flight finish and count). With several worker processes, each takes an equal share of the
concurrency, request count or rate; superposed Poisson streams are Poisson, and constant streams are
phase-shifted so the merged stream stays constant. Every process also measures itself (event-loop lag,
CPU, lateness of scheduled sends) so a saturated client can be reported instead of mistaken for a slow server.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import multiprocessing as mp
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from .metrics import ClientLoad, RequestRecord, percentile
from .transport import Transport, TransportSpec
from .transports import open_transport
from .workload import Prompt

Arrival = Literal["poisson", "constant"]
_LOOP_PROBE_S = 0.005


@dataclass(frozen=True)
class Level:
    """One load level: a concurrency, or a request rate (optionally capped by a concurrency)."""

    concurrency: int | None = None
    request_rate: float | None = None

    @property
    def mode(self) -> str:
        return "rate" if self.request_rate is not None else "concurrency"

    @property
    def label(self) -> str:
        return f"rate {self.request_rate:g}/s" if self.request_rate is not None else f"concurrency {self.concurrency}"


@dataclass(frozen=True)
class LoadSettings:
    max_tokens: int
    timeout_s: float
    requests: int | None = None  # per level; None with duration_s
    duration_s: float | None = None
    arrival: Arrival = "poisson"
    seed: int = 0


@dataclass(frozen=True)
class Sent:
    """One finished request: the record (OSL = non-empty responses until counted) and its text."""

    record: RequestRecord
    text: bytes


def share(total: int, worker: int, workers: int) -> int:
    """Worker `worker`'s part of `total` when split as evenly as possible."""
    return total // workers + (1 if worker < total % workers else 0)


def arrival_gaps(rate: float, arrival: Arrival, rng: random.Random) -> Callable[[], float]:
    """Seconds to the next arrival for a stream of `rate` requests/s."""
    if arrival == "constant":
        return lambda: 1.0 / rate
    return lambda: rng.expovariate(rate)


class _Monitor:
    """Event-loop lag (a 5 ms timer's lateness) and CPU share of this process over a level."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._task: asyncio.Task | None = None

    async def _probe(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(_LOOP_PROBE_S)
            self.lags.append(time.perf_counter() - t - _LOOP_PROBE_S)

    def start(self) -> None:
        self._cpu0, self._wall0 = time.process_time(), time.perf_counter()
        self._task = asyncio.get_running_loop().create_task(self._probe())

    def stop(self, send_lags: Sequence[float]) -> ClientLoad:
        assert self._task is not None
        self._task.cancel()
        wall = max(time.perf_counter() - self._wall0, 1e-9)
        lags = sorted(self.lags) or [0.0]
        sends = sorted(send_lags)
        return ClientLoad(
            workers=1,
            cpu_percent=100.0 * (time.process_time() - self._cpu0) / wall,
            loop_lag_ms_p99=1000.0 * max(0.0, percentile(lags, 99)),
            loop_lag_ms_max=1000.0 * max(0.0, lags[-1]),
            loop_lag_ms_p90=1000.0 * max(0.0, percentile(lags, 90)),
            send_lag_ms_p99=1000.0 * max(0.0, percentile(sends, 99)) if sends else None,
        )


def merge_loads(loads: Sequence[ClientLoad]) -> ClientLoad:
    """The worst process decides: one saturated process skews the whole level."""
    sends = [x.send_lag_ms_p99 for x in loads if x.send_lag_ms_p99 is not None]
    return ClientLoad(
        workers=len(loads),
        cpu_percent=max(x.cpu_percent for x in loads),
        loop_lag_ms_p99=max(x.loop_lag_ms_p99 for x in loads),
        loop_lag_ms_max=max(x.loop_lag_ms_max for x in loads),
        loop_lag_ms_p90=max(x.loop_lag_ms_p90 for x in loads),
        send_lag_ms_p99=max(sends) if sends else None,
    )


async def drive_level(
    transport: Transport,
    level: Level,
    settings: LoadSettings,
    prompts: Sequence[Prompt],
    worker: int = 0,
    workers: int = 1,
    on_done: Callable[[], None] | None = None,
    start_s: float | None = None,
) -> tuple[list[Sent], ClientLoad]:
    """Run this worker's share of one level on `transport`; request failures are recorded, never raised."""
    done: list[Sent] = []
    send_lags: list[float] = []
    concurrency_tag = level.concurrency or 0
    # A concurrency below the process count leaves some processes idle rather than at zero slots.
    active = min(workers, level.concurrency) if level.concurrency else workers
    if worker >= active:
        return [], ClientLoad(workers=1, cpu_percent=0.0, loop_lag_ms_p99=0.0, loop_lag_ms_max=0.0)
    workers = active
    cap = share(level.concurrency, worker, workers) if level.concurrency else None
    quota = share(settings.requests, worker, workers) if settings.requests is not None else None
    t0 = start_s if start_s is not None else time.perf_counter()
    deadline = t0 + settings.duration_s if settings.duration_s is not None else math.inf

    async def one(index: int, scheduled: float | None) -> None:
        rid = worker + workers * index  # unique across processes
        prompt = prompts[rid % len(prompts)]
        max_tokens = prompt.output_tokens or settings.max_tokens
        ex = await transport.send(prompt.text, max_tokens, str(rid), settings.timeout_s)
        record = RequestRecord(
            request_id=rid,
            concurrency=concurrency_tag,
            start_s=ex.start_s,
            first_response_s=ex.first_s,
            end_s=ex.end_s,
            chunk_times_s=tuple(ex.times),
            input_tokens=prompt.input_tokens,
            output_tokens=ex.chunks if ex.error is None else 0,
            ok=ex.error is None,
            error=ex.error,
            requested_output_tokens=max_tokens,
            scheduled_s=scheduled,
            worker=worker,
            reported_output_tokens=ex.reported_tokens,
        )
        if scheduled is not None and cap is None:
            send_lags.append(ex.start_s - scheduled)
        done.append(Sent(record, ex.text))
        if on_done is not None:
            on_done()

    monitor = _Monitor()
    monitor.start()
    if time.perf_counter() < t0:
        await asyncio.sleep(t0 - time.perf_counter())
    if level.request_rate is None:
        indices = itertools.count()

        async def closed_loop() -> None:
            while (i := next(indices)) < (quota if quota is not None else math.inf):
                if time.perf_counter() >= deadline:
                    return
                await one(i, None)

        await asyncio.gather(*(closed_loop() for _ in range(min(cap or 0, quota if quota is not None else cap or 0))))
    else:
        rate = level.request_rate / workers
        rng = random.Random(f"{settings.seed}-{level.request_rate}-{worker}")
        gap = arrival_gaps(rate, settings.arrival, rng)
        # Constant arrivals: shift each process by its slot, so the merged stream is evenly spaced.
        due = t0 + (worker / level.request_rate if settings.arrival == "constant" else gap())
        slots = asyncio.Semaphore(cap) if cap else None
        tasks: list[asyncio.Task] = []

        async def capped(i: int, scheduled: float) -> None:
            if slots is None:
                await one(i, scheduled)
                return
            async with slots:
                await one(i, scheduled)

        for i in itertools.count():
            if (quota is not None and i >= quota) or due >= deadline:
                break
            if (wait := due - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.get_running_loop().create_task(capped(i, due)))
            due += gap()
        await asyncio.gather(*tasks)
    load = monitor.stop(send_lags)
    return sorted(done, key=lambda s: s.record.request_id), load


# --- several processes ------------------------------------------------------------------------------

_barrier: Any = None
_counter: Any = None


def _init_worker(barrier: Any, counter: Any) -> None:
    global _barrier, _counter
    _barrier, _counter = barrier, counter


def _count_one() -> None:
    with _counter.get_lock():
        _counter.value += 1


def _ping(_: int) -> bool:
    _barrier.wait(timeout=120)  # holds each process until all have started: one job per process
    return True


def _worker_level(
    spec: TransportSpec, level: Level, settings: LoadSettings, prompts: Sequence[Prompt], worker: int, workers: int
) -> tuple[list[Sent], ClientLoad]:
    async def main() -> tuple[list[Sent], ClientLoad]:
        transport = open_transport(spec)
        try:
            await transport.connect()
            await asyncio.to_thread(_barrier.wait, 120)  # every process connected: start together
            return await drive_level(transport, level, settings, prompts, worker, workers, _count_one)
        finally:
            await transport.close()

    return asyncio.run(main())


class LoadPool:
    """`workers` spawned processes that run each level together (spawn: grpc and fork do not mix)."""

    def __init__(self, spec: TransportSpec, workers: int) -> None:
        ctx = mp.get_context("spawn")
        self.spec, self.workers = spec, workers
        self.counter = ctx.Value("l", 0)
        self.barrier = ctx.Barrier(workers)
        self.pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                        initargs=(self.barrier, self.counter))
        # Start (and import) every process now, outside any measured level.
        list(self.pool.map(_ping, range(workers)))

    def run_level(
        self,
        level: Level,
        settings: LoadSettings,
        prompts: Sequence[Prompt],
        progress: Callable[[int], None] | None = None,
    ) -> tuple[list[Sent], ClientLoad]:
        with self.counter.get_lock():
            self.counter.value = 0
        futures: list[Future] = [
            self.pool.submit(_worker_level, self.spec, level, settings, prompts, w, self.workers)
            for w in range(self.workers)
        ]
        while not all(f.done() for f in futures):
            time.sleep(0.2)
            if progress is not None:
                progress(self.counter.value)
        results = [f.result() for f in futures]
        if progress is not None:
            progress(self.counter.value)
        sent = sorted((s for part, _ in results for s in part), key=lambda s: s.record.request_id)
        return sent, merge_loads([load for _, load in results])

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
