"""One holder at a time, fleet-wide: a Prefect global concurrency limit of one slot, created when missing.

Used where two runs must not overlap at all: two matrices of one deployment name would deploy the same
`<name>-<format>` entries, and two runs deploying one name would each reconcile away the other's candidate
(build_and_deploy's serving steps and `stoker rollback` hold `deploy_lock(name)`). The slot is a lease the holder's client renews; a holder killed outright frees it when
the lease runs out (Prefect's default, 300 s).
"""

from __future__ import annotations

import contextvars
import threading
from contextlib import contextmanager
from typing import Callable, Iterator


def deploy_lock(name: str) -> str:
    """The limit held while a run stages, gates, switches and watches deployment `name`."""
    return f"stoker-deploy-{name}"


def host_lock(name: str, host: str) -> str:
    """The name whose deploy_lock a fleet host's run (rollout or rollback) holds: the fleet run holds ``name``'s."""
    return f"{name}-host-{host}"


PROBE_S = 10.0  # a slot not acquired within this: the run says that it waits (exclusive)


def ensure_limit(name: str) -> None:
    """Create limit ``name`` (one slot) when missing."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            try:
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
            except ObjectAlreadyExists:  # another run created it first: the same one slot
                pass


@contextmanager
def exclusive(name: str, log: Callable[[str], None], what: str) -> Iterator[None]:
    """Hold the only slot of limit `name` for the block; says once that it waits, and for what.

    A lease renewal that fails (a loaded host, an API blip) does not cancel the holder: stopping a deploy midway
    would do more harm than a rare overlap after the lease expires."""
    from prefect.concurrency.sync import concurrency

    # Whether it waits is told by a watcher, not by a timed acquisition: Prefect logs every timed-out acquisition as
    # an ERROR, and on a loaded host even a free slot took over 10 s to acquire (seen in fresh-clone CI's clean-logs
    # checks). The watcher runs in this run's context, so what it says reaches the run's log.
    ensure_limit(name)
    acquired, waited = threading.Event(), threading.Event()

    def say_it_waits() -> None:
        if not acquired.wait(PROBE_S):
            waited.set()
            log(f"{what}: waiting for it to finish (Prefect concurrency limit {name!r})")

    watcher = threading.Thread(target=contextvars.copy_context().run, args=(say_it_waits,), daemon=True)
    watcher.start()
    try:
        with concurrency(name, occupy=1, strict=True, raise_on_lease_renewal_failure=False):
            acquired.set()
            watcher.join()
            if waited.is_set():
                log(f"{what}: finished; going on")
            yield
    finally:
        acquired.set()  # also when acquiring failed: the watcher says nothing more
