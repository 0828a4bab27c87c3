"""Prefect tasks: one module per external system, each a thin shell over stoker's library."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from stoker.errors import is_transient


def retry_transient(task_, task_run, state) -> bool:
    """Retry only failures that can heal (connection drops, busy servers), never bad input."""
    try:
        state.result()
    except Exception as exc:  # noqa: BLE001 - we only classify it
        return is_transient(exc)
    return False


def step_task(name: str, retries: int = 3):
    # Our own content-addressed store does the caching (it also serves `stoker plan`),
    # so Prefect's result cache stays off.
    return task(name=name, retries=retries, retry_delay_seconds=[2, 5, 15], retry_condition_fn=retry_transient,
                cache_policy=NO_CACHE, persist_result=False)
