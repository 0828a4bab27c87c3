"""Which routes the stable address serves (stoker/serving/haproxy.py): inference, health, metadata; nothing else.
The proxy itself is tested in tests/integration/test_endpoint_boundary.py; here, the rendered rules."""

from __future__ import annotations

import re

import pytest

from stoker.serving import haproxy
from stoker.containers.ports import Ports

LAYOUT = haproxy.ProxyLayout(Ports(8000, 8001, 8002), {"blue": Ports(20000, 20001, 20002)}, "blue")


def _public(path: str) -> bool:
    return path in haproxy.PUBLIC_HTTP_EXACT or re.match(haproxy.PUBLIC_HTTP_MODEL, path) is not None


@pytest.mark.parametrize("path", ["/v2", "/v2/health/ready", "/v2/models/ensemble", "/v2/models/ensemble/ready",
                                  "/v2/models/ensemble/generate_stream", "/v2/models/ensemble/versions/1/infer",
                                  "/v2/models/tensorrt_llm/config"])
def test_inference_health_and_metadata_are_public(path):
    assert _public(path)


@pytest.mark.parametrize("path", ["/v2/repository/index", "/v2/repository/models/ensemble/unload", "/v2/logging",
                                  "/v2/trace/setting", "/v2/models/ensemble/stats", "/v2/models/ensemble/trace/setting",
                                  "/v2/systemsharedmemory/status", "/v2/cudasharedmemory/region/x/register",
                                  "/v2/models/ensemble/generate_stream/../../repository/index", "/", "/metrics"])
def test_control_and_everything_else_is_not(path):
    assert not _public(path)


def test_every_frontend_refuses_what_is_not_public():
    cfg = haproxy.render(LAYOUT)
    # one refusal per frontend (http, grpc, metrics) and the ensemble's internal steps on http; the others are the
    # endpoint's bounds (413, 429: edge.py)
    refusals = [ln for ln in cfg.splitlines() if "http-request return" in ln and " status 413 " not in ln
                and " status 429 " not in ln and "grpc-status 8 " not in ln]
    assert len(refusals) == 4 and refusals[1].endswith(" if internal_model"), refusals
    grpc = cfg[cfg.index("frontend grpc"):cfg.index("backend grpc")]
    assert "hdr grpc-status 7" in grpc and "/inference.GRPCInferenceService/ModelStreamInfer" in grpc
    assert "RepositoryModelUnload" not in grpc and "ModelStatistics" not in grpc


def test_the_metrics_port_serves_v1_only_where_the_backends_host_tritons_openai_frontend():
    import dataclasses

    plain = haproxy.render(LAYOUT)
    metrics = plain[plain.index("frontend metrics"):plain.index("backend metrics")]
    assert "/v1/" not in metrics and '"only /metrics is served here" if !{ path /metrics }' in metrics
    hosted = haproxy.render(dataclasses.replace(LAYOUT, metrics_openai=True))
    metrics = hosted[hosted.index("frontend metrics"):hosted.index("backend metrics")]
    assert "acl openai path_beg /v1/" in metrics and "if !{ path /metrics } !openai" in metrics




@pytest.mark.parametrize("path", ["/v2/models/preprocessing", "/v2/models/preprocessing/infer",
                                  "/v2/models/postprocessing/versions/1/infer", "/v2/models/postprocessing/config"])
def test_the_ensembles_internal_steps_are_refused(path):
    # The only models stoker serves that are not decoupled: the CPU image's Triton 2.51 allocates an /infer input by
    # its declared shape before reading it (a 2**62-element shape killed it). haproxy.INTERNAL_MODELS says why.
    acl = next(ln for ln in haproxy.render(LAYOUT).splitlines() if "acl internal_model path_reg" in ln)
    assert re.search(acl.split("path_reg ", 1)[1], path)
    for client_model in ("/v2/models/ensemble/infer", "/v2/models/tensorrt_llm/generate", "/v2/models/preproc/infer"):
        assert not re.search(acl.split("path_reg ", 1)[1], client_model)
