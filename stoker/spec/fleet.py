"""The spec's `fleet` section: several serving hosts, each a Docker engine with its own Prefect work pool, rolled
out one wave at a time (docs/serving.md#fleet).

Pure data. What is checked here is what the spec alone can say (names, waves, engines named twice); whether an
engine answers, or two names reach one engine, or a host's pool has a worker, is the preflight's
(stoker/serving/fleet.py, tasks/fleet.py).
"""

from __future__ import annotations

import ipaddress
import re

from pydantic import Field, field_validator, model_validator

from .base import _Section

_HOST = re.compile(r"^[a-z0-9][a-z0-9-]{0,30}$")


class HostPorts(_Section):
    """A host's stable endpoint (its proxy): hosts that share one network namespace (two engines on one machine)
    need distinct ones."""

    http: int = Field(ge=1, le=65535)
    grpc: int = Field(ge=1, le=65535)
    metrics: int = Field(ge=1, le=65535)

    @model_validator(mode="after")
    def _distinct(self) -> HostPorts:
        if len({self.http, self.grpc, self.metrics}) != 3:
            raise ValueError("http, grpc and metrics ports must differ")
        return self


class Host(_Section):
    name: str = Field(description="[a-z0-9-]+, unique in the fleet")
    docker_host: str = Field(description="this host's Docker engine (unix:// or tcp://)")
    deployment: str = Field(description="FLOW/DEPLOYMENT of serve_host on this host's work pool")
    ports: HostPorts | None = Field(None, description="this host's stable endpoint; default: deploy.ports")
    address: str = Field("127.0.0.1", description="where the front proxy reaches this host's stable endpoint")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _HOST.match(v):
            raise ValueError(f"fleet host {v!r}: use lowercase letters, digits and '-'")
        return v

    @field_validator("deployment")
    @classmethod
    def _deployment(cls, v: str) -> str:
        if v.count("/") != 1 or not all(v.split("/")):
            raise ValueError(f"fleet host deployment {v!r} is not FLOW/DEPLOYMENT")
        return v

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        try:
            return str(ipaddress.ip_address(v))
        except ValueError:
            raise ValueError(f"fleet host address {v!r} is not an IP address") from None


class Front(_Section):
    """A front HAProxy on the local engine across the hosts' stable endpoints; it drains a host while it rolls."""

    http: int = Field(ge=1, le=65535)
    grpc: int = Field(ge=1, le=65535)

    @model_validator(mode="after")
    def _distinct(self) -> Front:
        if self.http == self.grpc:
            raise ValueError("fleet.front: http and grpc ports must differ")
        return self


class Fleet(_Section):
    hosts: list[Host] = Field(min_length=1)
    waves: list[list[str]] | None = Field(None, description="host names per wave, in order; default: the first "
                                          "host alone (canary), then all the rest as one batch")
    front: Front | None = None
    host_timeout_s: float = Field(1800, gt=0, le=24 * 3600, description="one host's rollout may take this long")
    start_timeout_s: float = Field(120, gt=0, le=3600, description="a host's worker must start its run within this")

    @model_validator(mode="after")
    def _consistent(self) -> Fleet:
        names = [h.name for h in self.hosts]
        for what, values in (("name", names), ("docker_host", [h.docker_host for h in self.hosts])):
            dup = sorted({v for v in values if values.count(v) > 1})
            if dup:
                raise ValueError(f"fleet: {what} {dup[0]!r} names two hosts")
        waves = self.plan()
        seen: list[str] = [n for wave in waves for n in wave]
        for n in seen:
            if n not in names:
                raise ValueError(f"fleet: a wave names unknown host {n!r} (hosts: {', '.join(names)})")
        for n in names:
            if seen.count(n) != 1:
                raise ValueError(f"fleet: host {n!r} is in {seen.count(n) or 'no'} waves (each host is in one)")
        if any(not wave for wave in waves):
            raise ValueError("fleet: an empty wave")
        return self

    def plan(self) -> list[list[str]]:
        """The waves in order: the spec's, or the first host alone then the rest."""
        if self.waves is not None:
            return [list(w) for w in self.waves]
        names = [h.name for h in self.hosts]
        return [names[:1], names[1:]] if len(names) > 1 else [names]

    def host(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)
