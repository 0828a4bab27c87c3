"""`stoker demo`: the CPU reference pipeline on embedded defaults, against real local servers.

Starts (or reuses) a Hub mirror serving a generated tiny Llama, an S3 server,
a Docker daemon, the CPU Triton image and a Prefect server with its UI and a
process worker (stack/demo_prefect.py), then runs build_and_deploy and leaves
the endpoint and the UI up. `stoker down` stops only what the demo started.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import yaml

from .orchestration.child import run_module
from .run import stoker_home
from .spec.schema import Spec
from .spec.load import parse_spec

DEMO_SPEC = Path(__file__).resolve().parent / "demo.yaml"
DEMO_REPO = "stoker/tiny-llama"
DEMO_ADAPTER_REPO = "stoker/tiny-llama-lora"  # the demo spec serves it as model `demo-lora`
HUB_PORT = int(os.environ.get("STOKER_DEMO_HUB_PORT", "18090"))
S3_PORT = int(os.environ.get("STOKER_DEMO_S3_PORT", "19000"))


def state_dir() -> Path:
    return stoker_home() / "stack"


def demo_spec(hub_endpoint: str, s3_url: str) -> Spec:
    data = yaml.safe_load(DEMO_SPEC.read_text())
    data["model"]["endpoint"] = hub_endpoint
    data["storage"]["endpoint_url"] = s3_url
    return parse_spec(data, "embedded demo spec")


def ensure_tiny_model(repos: Path, log=print) -> None:
    """Generate the tiny Llama and its LoRA adapter once, each published to the mirror as its repo's first commit.

    Checked one by one: a demo state from before the adapter existed gains the adapter and keeps its base.
    """
    from .stack.hub_mirror import publish_model

    base = repos / "models" / DEMO_REPO
    if not (base / ".git").exists():
        log(f"demo: generating the tiny Llama + tokenizer offline → {DEMO_REPO}")
        with tempfile.TemporaryDirectory() as tmp:
            run_module("stoker.workers.tinymodel", ["--out", tmp, "--seed", "0"], log)
            publish_model(repos, DEMO_REPO, Path(tmp), "tiny Llama for the stoker demo")
    if not (repos / "models" / DEMO_ADAPTER_REPO / ".git").exists():
        log(f"demo: generating a LoRA adapter for it offline → {DEMO_ADAPTER_REPO}")
        with tempfile.TemporaryDirectory() as tmp:
            run_module("stoker.workers.tinyadapter", ["--base", str(base), "--out", tmp, "--seed", "1",
                                                      "--repo-id", DEMO_REPO], log)
            publish_model(repos, DEMO_ADAPTER_REPO, Path(tmp), "a tiny LoRA adapter for the demo's Llama")


def start_stack(log=print) -> tuple[str, str]:
    from .stack.dockerd import ensure_daemon
    from .stack.hub_mirror import ensure_mirror, repos_dir
    from .stack.s3server import ensure_s3, s3_env

    state = state_dir()
    ensure_tiny_model(repos_dir(state), log)
    hub = ensure_mirror(state, HUB_PORT)
    log(f"demo: Hub mirror (olah) at {hub}")
    s3_url = ensure_s3(state, S3_PORT, data_dir=state / "s3-data")  # kept on disk: a reboot loses no build or run
    # The demo's S3 is local: use its throwaway credentials, never the caller's real AWS keys.
    os.environ.update({k: v for k, v in s3_env(s3_url).items() if k != "AWS_ENDPOINT_URL"})
    log(f"demo: S3 (moto, objects kept in {state / 's3-data'}) at {s3_url}")
    if ensure_daemon(None, state):
        log("demo: started dockerd")
    spec_image = yaml.safe_load(DEMO_SPEC.read_text()).get("deploy", {}).get("image")
    from .spec.schema import Deploy

    image = spec_image or Deploy().image
    from .stack.image import ensure_proxy_image

    ensure_proxy_image(Deploy().proxy_image, None, log, base=image)  # the Triton image first, then the proxy's
    return hub, s3_url


def run_demo(log=print) -> tuple[dict, str | None]:
    """Run the demo; returns its manifest and the URL of its flow run in the Prefect UI (None: no UI to show)."""
    from .launch import run_flow
    from .stack import demo_prefect

    hub, s3_url = start_stack(log)
    spec = demo_spec(hub, s3_url)
    api = demo_prefect.ensure_api(state_dir(), stoker_home() / "prefect-stack", log)
    if api is not None:
        demo_prefect.use_api(api)
        demo_prefect.ensure_demo_worker(state_dir(), api)
    ui = api.ui_url if api else None
    log(f"demo: Prefect UI at {ui}" if ui else f"demo: reporting to your Prefect API at {demo_prefect.user_api()}")

    def register(flow) -> None:  # while the flow is imported; a failed run still leaves its deployment
        if api is not None:
            demo_prefect.register_deployment(flow, spec)

    manifest, flow_run_id = run_flow(spec, before=register)
    return manifest, f"{ui}/runs/flow-run/{flow_run_id}" if ui and flow_run_id else None


def down() -> list[str]:
    """Stop the demo's containers, servers and (if it started it) dockerd; nothing else."""
    from .stack.dockerd import stop_daemon
    from .stack.services import stop_all

    lines = []
    state = state_dir()
    try:
        import docker

        from .containers.engine import remove_deployment

        client = docker.from_env()
        client.ping()
        name = yaml.safe_load(DEMO_SPEC.read_text())["deploy"]["name"]
        lines += [f"removed container {c}" for c in remove_deployment(client, name, lambda _m: None)]
    except Exception as err:  # noqa: BLE001 - no daemon means no containers to stop
        lines.append(f"containers: skipped ({str(err).splitlines()[0][:100]})")
    lines += [f"stopped {s}" for s in stop_all(state)]
    if stop_daemon(state):
        lines.append("stopped dockerd (started by the demo)")
    return lines or ["nothing to stop"]
