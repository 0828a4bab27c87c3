"""The Prefect tasks a target's steps run (stoker.targets.base.Tasks), handed to the target by the flow.

stoker sits below tasks/, so a target asks `steps.tasks` for its tasks instead of importing them. Each is read
from its module when asked, not bound once here: a test that replaces a task in its module is heard.
"""

from __future__ import annotations

from types import ModuleType

from tasks import evaluate, gate, modelopt, reference, rollout, routing, s3, triton_client, triton_repo, trtllm

_HOMES: dict[str, ModuleType] = {
    "quantize_weights": modelopt, "build_reference": reference, "package_repository": triton_repo,
    "stage_candidate": rollout, "switch_traffic": rollout, "abandon_candidate": rollout, "scrape_metrics": rollout,
    "benchmark_endpoint": triton_client, "gate_benchmark": gate,
    "evaluate_candidate": evaluate, "baseline_reference": evaluate, "baseline_recorded": evaluate,
    "build_gpu": trtllm, "package_gpu": trtllm, "upload_repository": s3, "remove_candidate": rollout,
    "decide_gpu_rollout": rollout, "settle_gpu_rollout": rollout, "route_heavy_steps": routing, "mark_routed": routing,
}


class TargetTasks:
    def __getattr__(self, name: str):
        try:
            home = _HOMES[name]
        except KeyError:
            raise AttributeError(f"no task {name!r} for targets") from None
        return getattr(home, name)
