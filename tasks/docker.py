"""deploy: the CPU Triton container, loading the repository straight from S3."""

from __future__ import annotations

import time

from prefect import get_run_logger

from stoker import docker_engine, s3
from stoker.run import RunContext, StepResult
from stoker.spec import Spec

from . import step_task


def deploy_request(spec: Spec, uploaded: StepResult) -> docker_engine.DeployRequest:
    d = spec.deploy
    env = s3.credentials_env() | {"AWS_DEFAULT_REGION": spec.storage.region}
    return docker_engine.DeployRequest(
        name=d.name, image=d.image, repository_uri=uploaded.detail["repository_uri"], repo_digest=uploaded.digest,
        env=env, ports=docker_engine.Ports(http=d.ports.http, grpc=d.ports.grpc, metrics=d.ports.metrics),
        standby_port_offset=d.standby_port_offset, shm_size=d.shm_size,
        ulimits={k: (v.soft, v.hard) for k, v in d.ulimits.items()}, ready_timeout_s=d.ready_timeout_s)


@step_task("deploy", retries=0)
def deploy_endpoint(spec: Spec, uploaded: StepResult, ctx: RunContext) -> StepResult:
    """Start (or keep) the container serving this repository digest; the old one goes only once ready."""
    logger = get_run_logger()
    t0 = time.perf_counter()
    client = docker_engine.connect(spec.deploy.docker_host)
    res = docker_engine.deploy(client, deploy_request(spec, uploaded), logger.info)
    return StepResult(name="deploy", cache_hit=res.reused, duration_s=time.perf_counter() - t0,
                      key=uploaded.digest[:24], digest=uploaded.digest,
                      detail={"container": res.container_name, "container_id": res.container_id,
                              "http": res.http_url, "grpc": res.grpc_url, "replaced": res.replaced,
                              "image": spec.deploy.image})
