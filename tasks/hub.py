"""fetch: weights from the Hub (or a local folder) at a resolved commit."""

from __future__ import annotations

import shutil
from pathlib import Path

from prefect import get_run_logger

from stoker.storage import hub, model_signature
from stoker import adapters
from stoker.cache.keys import adapters_key, fetch_key
from stoker.run import RunContext, StepResult, cached_step
from stoker.storage.source import hub_endpoint, hub_token, local_selection, resolve_source
from stoker.spec.schema import Spec

from . import step_task


@step_task("fetch")
def fetch_weights(spec: Spec, ctx: RunContext) -> StepResult:
    """Download the safetensors, configs and tokenizer at the resolved revision."""
    log = get_run_logger().info
    source_id, source = resolve_source(spec)
    m = spec.model
    # The model's own signature, before the weights: an unsigned model under require_signature, or a bad
    # signature, is refused having downloaded a few KB.
    signed = model_signature.check_signature(spec, source_id, log)

    def produce(out: Path) -> dict:
        if m.local_path is not None:
            names, _ = local_selection(m.local_path, m.allow_pickle)
            for n in names:
                (out / n).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(m.local_path / n, out / n)
        else:
            out.rmdir()  # hub.fetch publishes the folder itself, atomically
            hub.fetch(m.repo_id, source_id, hub_endpoint(m), hub_token(m), out, allow_pickle=m.allow_pickle,
                      progress=log)
        return source

    fetched = cached_step(ctx, "fetch", fetch_key(spec, source_id), produce, log)
    if signed is not None:  # a cache hit is checked too: the entry may predate the key
        root = Path(fetched.path).as_uri() + "/"
        model_signature.check_files(signed, {o.uri.removeprefix(root): o.sha256 for o in fetched.outputs},
                                    str(m.local_path) if m.local_path is not None else f"{m.repo_id}@{source_id[:12]}")
        fetched.detail = {**fetched.detail, "signature": "verified"}
    return fetched


@step_task("adapters")
def fetch_adapters(spec: Spec, fetched: StepResult, ctx: RunContext) -> StepResult:
    """The spec's LoRA adapters at their resolved commits, checked against the fetched base (stoker/adapters.py):
    one that does not fit fails here, before any heavy step."""
    log = get_run_logger().info
    shas = adapters.resolve(spec)

    def produce(out: Path) -> dict:
        return {"adapters": adapters.fetch_all(spec, shas, Path(fetched.path), out, log)}

    return cached_step(ctx, "adapters", adapters_key(spec, shas, fetched.digest), produce, log)
