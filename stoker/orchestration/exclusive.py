"""One holder at a time, fleet-wide: a Prefect global concurrency limit of one slot, created when missing.

Used where two runs must not overlap at all: two matrices of one deployment name would deploy the same
`<name>-<format>` entries, and two runs deploying one name would each reconcile away the other's candidate
(build_and_deploy's serving steps and `stoker rollback` hold `deploy_lock(name)`). The slot is a lease the holder's client renews; a holder killed outright frees it when
the lease runs out (Prefect's default, 300 s).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Callable, Iterator


PROBE_S = 10.0  # how long a free slot may take to acquire before the run says it waits (see exclusive)


def deploy_lock(name: str) -> str:
    """The limit held while a run stages, gates, switches and watches deployment `name`."""
    return f"stoker-deploy-{name}"


def ensure_limit(name: str) -> None:
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

    ensure_limit(name)
    with ExitStack() as held:
        try:
            # 10 s, not 1: on a loaded host acquiring a free slot took over a second, and Prefect logs every timed-out
            # acquisition as an ERROR (seen in a fresh-clone CI's clean-logs check); a run behind another deploy
            # waits far longer than this anyway, so it still says that it waits.
            held.enter_context(concurrency(name, occupy=1, timeout_seconds=PROBE_S, strict=True,
                                           raise_on_lease_renewal_failure=False))
        except TimeoutError:
            log(f"{what}: waiting for it to finish (Prefect concurrency limit {name!r})")
            held.enter_context(concurrency(name, occupy=1, strict=True, raise_on_lease_renewal_failure=False))
            log(f"{what}: finished; going on")
        yield
