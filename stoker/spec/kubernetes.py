"""The spec's `kubernetes` section: what `stoker render SPEC OUTDIR --kubernetes` needs beyond the one-host spec.

Pure data. The rollout strategy is not chosen here: it follows from the GPUs the spec lists, as on one host
(stoker/kubernetes/strategy.py).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from .base import _Section

_DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
Colour = Literal["blue", "green"]


def _label(v: str | None) -> str | None:
    if v is not None and not _DNS_LABEL.match(v):
        raise ValueError(f"{v!r} is not a Kubernetes name (lowercase letters, digits and '-', at most 63)")
    return v


class Autoscaling(_Section):
    """A HorizontalPodAutoscaler per colour on Triton's queue time, as Triton's own Helm example scales: a Pods
    metric the Prometheus adapter derives from nv_inference_queue_duration_us (docs/serving.md gives the rule)."""

    max_replicas: int = Field(ge=1, le=64, description="at most this many pods per colour; the minimum is "
                              "deploy.replicas")
    queue_time_us: int = Field(ge=1, description="target average queue time per request, microseconds, per pod")
    metric: str = Field("triton_queue_time_us", description="the Pods metric's name in the custom metrics API")


class Kubernetes(_Section):
    namespace: str = "default"
    stoker_image: str = Field("stoker/worker:0.1.0", description="the init container's image: stoker's CLI, which "
                              "syncs the repository from S3 (infra/worker/Dockerfile builds it)")
    s3_secret: str | None = Field(None, description="Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY for the "
                                  "sync; default: <deploy.name>-s3")
    live: Colour = Field("blue", description="the colour the stable Service selects (blue/green switch)")
    canary_percent: int = Field(0, ge=0, le=100, description="share of the HTTPRoute's traffic sent to the colour "
                                "that is not live; needs gateway")
    gateway: str | None = Field(None, description="the Gateway the HTTPRoute attaches to; no HTTPRoute without it")
    autoscaling: Autoscaling | None = None
    accept_downtime: bool = Field(False, description="let a one-replica deployment with no spare GPU stop its pod "
                                  "before the next one starts (Recreate); refused otherwise")
    gpu_resource: str = Field("nvidia.com/gpu", description="the device plugin's extended resource name")

    _names = field_validator("namespace", "s3_secret", "gateway")(classmethod(lambda cls, v: _label(v)))

    @model_validator(mode="after")
    def _canary_needs_gateway(self) -> Kubernetes:
        if self.canary_percent and self.gateway is None:
            raise ValueError(f"canary_percent {self.canary_percent} needs kubernetes.gateway: canary traffic is split "
                             "by a Gateway API HTTPRoute attached to it")
        return self
