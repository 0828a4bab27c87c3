"""A Prefect global-concurrency slot per GPU, so two GPU steps never share one GPU.

Limits are named ``gpu-<N>`` with one slot each (deployments/platform.yaml creates
``gpu-0``; add one per GPU of a host). A worker pinned to a GPU sets ``STOKER_GPU=N``.
Only targets whose heavy steps run on a GPU take one (stoker/targets/base.py). Where a limit does not exist Prefect skips it
with a warning, so a missing limit never blocks a run. GPU hosts: not runnable here.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager


def gpu_limit_name() -> str:
    return f"gpu-{os.environ.get('STOKER_GPU', '0')}"


def gpu_slot() -> AbstractContextManager:
    from prefect.concurrency.sync import concurrency

    return concurrency(gpu_limit_name(), occupy=1, strict=False)
