"""`stoker reconcile SPEC|NAME`: repair one deployment from what runs, without a pipeline run.

It reads the deployment's containers and its proxy's runtime state and takes the steps a run would take before
staging (stoker.serving.promote.reconcile): one live backend, stray backends removed, the proxy started, rerouted
or its config rewritten, the spec's API keys pushed, the OpenAI service following the live build. It prints what it
did, or that nothing needed repair; it stages nothing and never changes which build serves.

SPEC is the spec file a run deployed with: it holds the ports, images and the API keys' source. NAME (deploy.name)
uses the spec of the newest run of that deployment recorded under $STOKER_HOME/runs on this host.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ..errors import StokerError


class NoSpec(StokerError):
    """Neither a spec file nor a deployment with a run recorded on this host."""


def spec_of(spec_or_name: str):
    """The spec of ``spec_or_name``: a spec file, else the newest local run of that deployment's (see the module)."""
    from ..spec.load import load_spec, parse_spec

    if Path(spec_or_name).is_file() or spec_or_name.endswith((".yaml", ".yml")):
        return load_spec(spec_or_name)
    from ..record.manifest import read_manifests
    from ..run import stoker_home

    home = stoker_home()
    runs = [m for m in read_manifests(home)
            if ((m.get("spec") or {}).get("deploy") or {}).get("name") == spec_or_name]
    if not runs:
        raise NoSpec(f"{spec_or_name!r} is neither a spec file nor a deployment with a run under {home / 'runs'}: "
                     "pass the spec file it was deployed with")
    newest = max(runs, key=lambda m: m.get("run_id", ""))
    return parse_spec(newest["spec"], f"manifest of {newest['run_id']}")


def deploy_lock_held(name: str):
    """With a Prefect API, wait for a run that is deploying ``name`` (it reconciles too); without one there is
    nobody to wait for (an ephemeral API would be this process's alone)."""
    from ..orchestration.exclusive import deploy_lock, exclusive

    if not os.environ.get("PREFECT_API_URL"):
        return contextlib.nullcontext()
    return exclusive(deploy_lock(name), print, f"a run is deploying {name!r}")


def reconcile(spec, log=print) -> list[str]:
    """Repair ``spec``'s deployment; returns the actions taken (empty: it was consistent)."""
    from ..containers import engine
    from ..deploy import rollout
    from ..serving import promote
    from .status import require_known

    client = engine.connect(spec.deploy.docker_host)
    # Only what runs is repaired: after `stoker down`, this does not bring a lone proxy back.
    require_known(client, spec.deploy.name)
    target = rollout.target_for(spec)
    actions: list[str] = []

    def note(line: str) -> None:
        actions.append(line)
        log(line)

    # The backends' S3 keys, valid now: a backend Docker restarts later (a reboot, a crash) reads them at its start.
    from ..storage import credentials

    try:
        credentials.refresh(spec)
    except credentials.CredentialsError as err:  # the proxy and the backends still get repaired
        log(f"reconcile {spec.deploy.name}: the backends' S3 credentials were not refreshed: {err}")
    live = promote.reconcile(client, target, note)
    if live is None:
        log(f"reconcile {spec.deploy.name}: no backend serves (a run or `stoker rollback` stages one)")
    else:
        log(f"reconcile {spec.deploy.name}: {'repaired' if actions else 'nothing to repair'}; "
            f"{live.container} serves digest {live.digest[:12]} (run {live.run_id or '-'}) at "
            f"{target.endpoint['http']}")
    return actions


def _handler(args) -> int:
    spec = spec_of(args.spec)
    with deploy_lock_held(spec.deploy.name):
        reconcile(spec)
    return 0


def register(sub) -> None:
    p = sub.add_parser("reconcile", help="repair one deployment (proxy, backends, API keys, OpenAI service) from "
                                         "what runs, without a pipeline run")
    p.add_argument("spec", metavar="SPEC|NAME", help="the spec file it was deployed with, or its deploy.name (the "
                                                      "spec of its newest run on this host)")
    p.set_defaults(fn=_handler)
