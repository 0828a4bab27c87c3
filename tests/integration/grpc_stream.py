"""Serving a tiny checkpoint with the local tritonserver, and one request to a decoupled model over gRPC
stream_infer (decoupled models answer only there)."""

from __future__ import annotations

import queue
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

_DTYPES = {np.dtype(object): "BYTES", np.dtype(np.int32): "INT32", np.dtype(bool): "BOOL"}


def stream_responses(grpc_url: str, model_name: str, inputs: dict[str, np.ndarray], timeout_s: float = 120) -> list:
    """Every response of the request that carries outputs, up to the final flag."""
    tensors = []
    for name, data in inputs.items():
        t = grpcclient.InferInput(name, list(data.shape), _DTYPES[data.dtype])
        t.set_data_from_numpy(data)
        tensors.append(t)
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_url)
    client.start_stream(callback=partial(lambda q, result, error: q.put((result, error)), results))
    try:
        client.async_stream_infer(model_name, tensors, enable_empty_final_response=True)
        out = []
        while True:
            result, error = results.get(timeout=timeout_s)
            assert error is None, str(error)
            if result.get_response().outputs:
                out.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return out
    finally:
        client.stop_stream()
        client.close()


@contextmanager
def serve_checkpoint(ckpt: Path, root: Path):
    """Build ``ckpt`` with the real reference build step, assemble the Triton repository and serve it
    with the local tritonserver; yields (server, artifact folder)."""
    from stoker.stack import local_triton
    from stoker.triton.config import RepoSettings
    from stoker.triton.repository import assemble
    from stoker.workers import build_reference

    artifact = root / "artifact"
    build_reference.build(ckpt, artifact)
    repo = root / "repo"
    assemble(artifact, repo, RepoSettings(model_threads=1))
    (repo / "ensemble" / "1").mkdir(parents=True, exist_ok=True)  # Triton wants the ensemble's version folder
    server = local_triton.start(repo, local_triton.pick_free_ports(), root / "tritonserver.log")
    try:
        yield server, artifact
    finally:
        server.stop(deadline_s=30)
