"""The run-order check at deploy (stoker/record/ordering.py), as a Prefect task; called under the deploy lock."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from stoker.errors import StokerError
from stoker.spec.schema import Spec
from stoker.run import RunContext


class OlderRun(StokerError):
    """A run older than the one whose build serves, without force."""


def serving(spec: Spec) -> tuple[str | None, str | None]:
    """(run id, digest) of the backend the deployment's proxy routes to now; (None, None) when none does."""
    from stoker.containers import engine
    from stoker.containers.ports import Ports
    from stoker.run import stoker_home
    from stoker.serving import promote

    name = spec.deploy.name
    client = engine.connect(spec.deploy.docker_host)
    backends = promote.observe_backends(client, name)
    if not backends:
        return None, None
    view, _ = promote.observe_proxy(client, promote.Target(name, Ports(0, 0, 0), "", stoker_home() / "proxy" / name))
    live = next((b for b in backends if view.running and b.running and b.slot == view.live), None)
    return (live.run_id or None, live.digest) if live else (None, None)


def check(spec: Spec, run_id: str, force: bool, warn, digest: str | None = None) -> None:
    """Raise OlderRun (one line) when the serving build's run started after ``run_id`` (whose build is ``digest``);
    forced: one warning."""
    from stoker.record import ordering

    serving_run, live_digest = serving(spec)
    line = ordering.refusal(spec.deploy.name, run_id, serving_run, live_digest, force, digest)
    if line:
        raise OlderRun(line)
    if force and (was := ordering.refusal(spec.deploy.name, run_id, serving_run, live_digest, digest=digest)):
        warn(f"force: deploying it although {was.split('; pass force')[0]}")


@task(name="run-order-check", cache_policy=NO_CACHE, persist_result=False)
def refuse_older_run(spec: Spec, ctx: RunContext, force: bool = False, digest: str | None = None) -> None:
    """Refuse a run older than the one whose build serves (unless ``force``, or ``digest``, the run's build, is
    what serves), before anything is staged."""
    check(spec, ctx.run_id, force, get_run_logger().warning, digest)
