"""How a Kubernetes rollout gets GPUs for new pods while the old ones serve: the one-host choice (stoker/gpu/rollout.py)
carried over to a cluster, where a pod holds whole GPUs.

The spec's gpus.count is the deployment's GPU budget in the cluster (what it may hold at once). Per pod: parallel
tensor × pipeline GPUs; a colour at full scale: that × the replicas (autoscaling.max_replicas when set: the headroom
must hold at the largest scale, the stricter reading). What is left is spare:

- a candidate colour beside the live one (blue/green) needs a whole colour's GPUs spare, as surge does on one host;
- an update inside a colour surges by as many pods as the spare GPUs hold (maxSurge, maxUnavailable 0);
- no spare GPU, several replicas: one pod at a time goes down first (maxSurge 0, maxUnavailable 1), as NVIDIA's NIM
  operator rolls; capacity drops by one pod during the update, the Service never empties;
- no spare GPU, one replica: every update empties the Service, so it is refused unless the spec declares that gap
  (gpus.rollout reload, or kubernetes.accept_downtime): then Recreate. A surge there would leave the new pod Pending
  for ever (no GPU frees up while the old pod runs).

"shared" (two backends on one GPU, KV cache split) has no Kubernetes form: the NVIDIA device plugin gives each pod
whole GPUs. Counts are absolute integers, never percentages: Kubernetes rounds a percentage maxSurge up and
maxUnavailable down, which would surge onto GPUs that are not there.

Pure: the spec in, a Strategy or PlanRefused (one line naming the fix) out.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import PlanRefused

COLOURS = ("blue", "green")


@dataclass(frozen=True)
class Strategy:
    kind: str  # surge | one-at-a-time | recreate
    deployment_strategy: dict  # the Deployment's .spec.strategy
    gpus_per_pod: int  # 0: the CPU reference target
    spare_gpus: int | None  # None: no GPUs involved
    blue_green: bool  # a whole colour fits beside the live one
    pdb_max_unavailable: int
    note: str


def derive(spec, colour: str | None = None) -> Strategy:
    """The strategy for ``spec`` (its kubernetes section), refusing what cannot work. ``colour``: the colour being
    rendered; one that is not the live one is a candidate beside it and needs a whole colour of spare GPUs."""
    k = spec.kubernetes
    replicas = spec.deploy.replicas
    top = k.autoscaling.max_replicas if k.autoscaling else replicas
    if top < replicas:
        raise PlanRefused(f"kubernetes.autoscaling.max_replicas {top} is below deploy.replicas {replicas}: raise it to "
                          f"at least {replicas}")
    downtime = k.accept_downtime or (spec.gpus is not None and spec.gpus.rollout == "reload")
    candidate = colour is not None and colour != k.live
    if spec.gpus is None:  # CPU pods: no scarce device, the update surges by one pod
        return Strategy("surge", _rolling(1, 0), 0, None, True, 1,
                        "CPU pods: maxSurge 1, maxUnavailable 0; blue/green by the stable Service's selector")
    world = spec.parallel.world_size
    budget = spec.gpus.count
    need = world * top
    if budget < need:
        raise PlanRefused(f"gpus.count: {top} pod(s) of {world} GPU(s) each (tensor x pipeline) need {need} GPUs but "
                          f"gpus.count is {budget}: raise gpus.count or lower the replicas")
    if spec.gpus.rollout == "shared":
        raise PlanRefused("gpus.rollout: shared puts two backends on one GPU, which Kubernetes cannot (the device "
                          "plugin gives each pod whole GPUs): use surge with spare GPUs, reload, or auto")
    spare = budget - need
    blue_green = spare >= need
    if candidate and not blue_green:
        raise PlanRefused(f"colour {colour} beside the live {k.live} needs {need} spare GPUs (a whole colour) but "
                          f"gpus.count {budget} leaves {spare}: render the live colour (an update in place) or raise "
                          f"gpus.count to {2 * need}")
    pdb = 1 if replicas > 1 or downtime else 0
    if spec.gpus.rollout == "reload":
        return Strategy("recreate", {"type": "Recreate"}, world, spare, blue_green, pdb,
                        "gpus.rollout reload: Recreate (the old pods stop before the new start; a declared gap)")
    surge = min(spare // world, replicas)
    if surge:
        return Strategy("surge", _rolling(surge, 0), world, spare, blue_green, pdb,
                        f"{spare} spare GPU(s): maxSurge {surge}, maxUnavailable 0 (no capacity lost)")
    if spec.gpus.rollout == "surge":
        raise PlanRefused(f"gpus.rollout: surge needs {world} spare GPU(s) beyond the {need} the pods hold, but "
                          f"gpus.count is {budget}: raise gpus.count to {need + world} or use rollout auto or reload")
    if replicas > 1:
        return Strategy("one-at-a-time", _rolling(0, 1), world, 0, False, pdb,
                        f"no spare GPU: maxSurge 0, maxUnavailable 1 (one of {replicas} pods down at a time)")
    if not downtime:
        raise PlanRefused(f"one replica on {world} GPU(s) with no spare GPU: every Kubernetes rollout would stop it "
                          f"before its successor starts; raise gpus.count to {need + world}, raise deploy.replicas, or "
                          "declare the gap (kubernetes.accept_downtime: true or gpus.rollout: reload)")
    return Strategy("recreate", {"type": "Recreate"}, world, 0, False, pdb,
                    "one replica, no spare GPU, downtime declared: Recreate (a gap on every rollout)")


def _rolling(surge: int, unavailable: int) -> dict:
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": surge, "maxUnavailable": unavailable}}
