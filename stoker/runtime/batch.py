"""In-flight batching over the reference model, as TensorRT-LLM's batch manager schedules an engine.

One scheduler thread owns the model. Each pass of its loop:
1. admits waiting sequences, in arrival order, while fewer than `max_batch` run: each is prefilled
   alone (its prompt through the model with its own new cache) and its first token leaves at once;
2. runs one decode step for every running sequence together (`ReferenceModel.forward_batch`: one
   pass of the model over all their next tokens, attention per sequence over its own cache), and
   each sequence's next token leaves as soon as the step ends.
A sequence leaves the batch when it ends (end id, stop word, budget, context length) or is cancelled,
so a new one can join before the next step. More sequences than `max_batch` wait, never fail.

Per sequence, tokens are chosen by `generate.Decoding`, the same code `generate` runs alone, from its
own logits and its own seeded generator: sampling, stop words, end id, min tokens, repetition penalty
and log probs do not depend on what else is in the batch. Greedy ids equal the sequence alone (and
transformers' greedy generate); batched matrix products may differ from a lone pass in the last bits
of a logit, never by enough to change an argmax in the tests (tests/unit/test_batching.py).

Validation happens in `submit`, before anything is queued: an invalid or over-long request raises
ValueError there and the others never see it. A failure inside a step (an internal error) fails the
sequences of that step and the scheduler goes on.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .generate import Decoding, Record, start
from .model import ReferenceModel

DEFAULT_MAX_BATCH = 8
_END = object()


class Stream:
    """One submitted sequence: its tokens, in order, as the scheduler produces them."""

    def __init__(self, decoding: Decoding) -> None:
        self.decoding = decoding
        self.record: Record | None = decoding.record
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.cancelled = threading.Event()
        self.finished = False  # set by the scheduler thread once nothing more will come

    def cancel(self) -> None:
        """Stop generating at the next step (or before the prefill, while waiting); no-op once finished."""
        self.cancelled.set()

    def tokens(self, check: Callable[[], None] | None = None, poll_s: float = 0.05) -> Iterator[int]:
        """Yield the tokens; raise what failed the sequence. `check` runs every `poll_s` while waiting and may
        raise (a client cancel): the sequence is then cancelled and the exception goes on."""
        try:
            while True:
                try:
                    item = self._queue.get(timeout=poll_s) if check is not None else self._queue.get()
                except queue.Empty:
                    check()
                    continue
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.cancel()

    def __iter__(self) -> Iterator[int]:
        return self.tokens()

    # The scheduler's side.
    def _put(self, item: Any) -> None:
        self._queue.put(item)

    def _end(self, error: BaseException | None = None) -> None:
        if not self.finished:
            self.finished = True
            self._queue.put(_END if error is None else error)


class Batcher:
    """The in-flight batching scheduler of one model (see the module docstring); start() before submit()."""

    def __init__(self, model: ReferenceModel, max_batch: int = DEFAULT_MAX_BATCH, name: str = "stoker-batcher") -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model = model
        self.max_batch = max_batch
        # Whether steps run in one model pass; otherwise one pass per sequence, still in-flight scheduled.
        self.batched = max_batch > 1 and model.enable_batching()
        self._waiting: deque[Stream] = deque()
        self._running: list[Stream] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.steps = 0  # decode steps run, and how many sequences they carried (for tests and benchmarks)
        self.stepped_sequences = 0
        self.largest_step = 0

    def start(self) -> Batcher:
        self._thread.start()
        return self

    def submit(self, input_ids: Sequence[int], max_new_tokens: int, end_id: int, **kwargs: Any) -> Stream:
        """Queue one sequence (the arguments of `generate`); raises ValueError now for an invalid one."""
        stream = Stream(start(self.model, input_ids, max_new_tokens, end_id, **kwargs))
        with self._wake:
            if self._stopping:
                raise RuntimeError("the batcher is stopped")
            self._waiting.append(stream)
            self._wake.notify()
        return stream

    def counts(self) -> tuple[int, int]:
        """(running, waiting) now."""
        with self._wake:
            return len(self._running), len(self._waiting)

    def stop(self, error: BaseException | None = None, timeout_s: float = 30.0) -> None:
        """End the loop after the current step; every unfinished sequence ends with `error` (default: cancelled)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        failure = error or RuntimeError("the batcher stopped")
        with self._wake:
            for stream in [*self._running, *self._waiting]:
                stream._end(failure)
            self._running.clear()
            self._waiting.clear()

    # The scheduler thread.
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self._waiting and not self._running:
                    self._wake.wait()
                if self._stopping:
                    return
                admitted = []
                while self._waiting and len(self._running) + len(admitted) < self.max_batch:
                    stream = self._waiting.popleft()
                    if stream.cancelled.is_set():
                        stream._end()
                    else:
                        admitted.append(stream)
            for stream in admitted:
                self._prefill(stream)
            with self._wake:
                self._running = [s for s in self._running if self._live(s)]
                running = list(self._running)
            if running:
                self._step(running)
            with self._wake:
                self._running = [s for s in self._running if self._live(s)]

    @staticmethod
    def _live(stream: Stream) -> bool:
        if stream.cancelled.is_set():
            stream._end()
        return not stream.finished

    def _emit(self, stream: Stream, token: int | None) -> None:
        if token is not None:
            stream._put(token)
        if stream.decoding.done:
            stream._end()

    def _prefill(self, stream: Stream) -> None:
        try:
            stream.decoding.prefill()
            self._emit(stream, stream.decoding.choose())
        except Exception as exc:  # noqa: BLE001 -- this sequence fails alone
            stream._end(exc)
            return
        if not stream.finished:
            with self._wake:
                self._running.append(stream)

    def _step(self, running: list[Stream]) -> None:
        model = self.model
        try:
            if len(running) == 1 or not self.batched:  # alone: exactly the lone path of generate
                logits = [model.forward([s.decoding.pending], s.decoding.cache)[-1] for s in running]
            else:
                logits = model.forward_batch([s.decoding.pending for s in running], [s.decoding.cache for s in running])
        except Exception as exc:  # noqa: BLE001 -- the step's sequences fail; the scheduler goes on
            for stream in running:
                stream._end(exc)
            return
        self.steps += 1
        self.stepped_sequences += len(running)
        self.largest_step = max(self.largest_step, len(running))
        for stream, row in zip(running, logits):
            try:
                stream.decoding.feed(row)
                self._emit(stream, stream.decoding.choose())
            except Exception as exc:  # noqa: BLE001
                stream._end(exc)
