"""The OpenAI service in a deployment, its pure parts: the proxy's /v1/ route, when reconcile recreates the
proxy for it, the service's command, and which files of a model repository it reads."""

from __future__ import annotations

import pytest

from stoker.serving import edge, haproxy, openai_service
from stoker.containers.ports import Ports
from stoker.serving.topology import Backend, ProxyView, plan_repair

LISTEN = Ports(8000, 8001, 8002)


def test_proxy_routes_v1_to_the_service_socket_and_everything_else_to_triton():
    cfg = haproxy.render(haproxy.ProxyLayout(LISTEN, {"blue": Ports(20000, 20001, 20002)}, "blue",
                                             openai_service.socket_path()))
    http = cfg[cfg.index("frontend http"):cfg.index("\nbackend http") + 1]
    assert http == ("frontend http\n    bind 127.0.0.1:8000\n"
                    "    acl openai path_beg /v1/\n"
                    # the endpoint's bounds (stoker/serving/edge.py), before keys and routes
                    + "".join(f"{line}\n" for line in edge.frontend_lines("http", edge.EdgeLimits(), True))
                    + f"    acl public path {' '.join(haproxy.PUBLIC_HTTP_EXACT)}\n"
                    f"    acl public path_reg {haproxy.PUBLIC_HTTP_MODEL}\n"
                    f"    http-request return status 403 content-type application/json string "
                    f"{haproxy._quoted(haproxy.REFUSED_HTTP)} if !public !openai\n"
                    f"    acl internal_model path_reg ^/v2/models/(preprocessing|postprocessing)(/|$)\n"
                    f"    http-request return status 403 content-type application/json string "
                    f"{haproxy._quoted(haproxy.REFUSED_INTERNAL)} if internal_model\n"
                    "    use_backend openai if openai\n"
                    "    default_backend http\n\n")
    assert "    server openai /stoker/openai/api.sock\n" in cfg
    # The service down: OpenAI's error shape from the proxy, not HAProxy's HTML page.
    assert cfg.count("http-error status 503 content-type application/json string") == 1
    assert '\\"code\\": \\"backend_unavailable\\"' in cfg
    # gRPC and metrics have no such route; without a service, no route at all.
    assert cfg.count("path_beg") == 1
    assert "openai" not in haproxy.render(haproxy.ProxyLayout(LISTEN, {}, None))


def test_reconcile_recreates_a_proxy_whose_v1_route_is_not_the_wanted_one():
    blue = Backend("stoker-d-blue", "blue", Ports(20000, 20001, 20002), "aa", True, True)
    view = ProxyView(True, True, "blue", {"blue": 20000}, LISTEN, openai=False)
    assert plan_repair([blue], view, LISTEN, openai=True).proxy == "recreate"
    assert plan_repair([blue], view, LISTEN, openai=False).proxy == "ok"
    with_route = ProxyView(True, True, "blue", {"blue": 20000}, LISTEN, openai=True)
    assert plan_repair([blue], with_route, LISTEN, openai=True).proxy == "ok"
    assert plan_repair([blue], with_route, LISTEN).proxy == "ok"  # not asked: left as it is
    # A stopped proxy is started with the rewritten config, which has the route.
    assert plan_repair([blue], ProxyView(True, False, listen=LISTEN), LISTEN, openai=True).proxy == "start"


def test_service_command_and_config_key():
    args = openai_service.command("tiny")
    assert args == ["-m", "stoker_openai", "--model", "tiny", "--grpc", "unix:/stoker/openai/grpc.sock", "--state",
                    "/stoker/openai", "--uds", "/stoker/openai/api.sock"]
    key = openai_service.config_key("img:1", args, "c0de")
    assert key == openai_service.config_key("img:1", list(args), "c0de")
    assert len({key, openai_service.config_key("img:2", args, "c0de"),
                openai_service.config_key("img:1", openai_service.command("small"), "c0de"),
                openai_service.config_key("img:1", args, "c0df")}) == 4
    assert len(openai_service.code_digest()) == 64


def test_parse_triton_s3():
    from stoker.serving.backend_repo import parse_triton_s3

    assert parse_triton_s3("s3://127.0.0.1:19000/bucket/p/repos/abc/model_repository") == (
        "http://127.0.0.1:19000", "bucket", "p/repos/abc/model_repository")
    assert parse_triton_s3("s3://https://s3.example:443/b/k/") == ("https://s3.example:443", "b", "k")
    assert parse_triton_s3("s3://bucket/key/deeper") == (None, "bucket", "key/deeper")


def test_pick_assets_takes_the_newest_version_and_only_the_tokenizer_files():
    listing = {f"tensorrt_llm/{v}/weights/{f}": ("e", 1) for v in (1, 3)
               for f in ("tokenizer.json", "config.json", "model.safetensors", "stoker_runtime.json")}
    listing |= {"tensorrt_llm/1/model.py": ("e", 1), "tensorrt_llm/2/weights/config.json": ("e", 1),
                "tensorrt_llm/config.pbtxt": ("e", 1), "preprocessing/1/tokenizer/tokenizer.json": ("e", 1)}
    version, files = openai_service.pick_assets(listing)
    assert version == 3
    assert files == {"tokenizer.json": "tensorrt_llm/3/weights/tokenizer.json",
                     "config.json": "tensorrt_llm/3/weights/config.json",
                     "stoker_runtime.json": "tensorrt_llm/3/weights/stoker_runtime.json"}


def test_a_real_engines_repository_serves_preprocessings_tokenizer_and_the_deployed_limits():
    # What trtllm-build writes (config.json, rank*.engine) holds no tokenizer: the engine layout's is preprocessing's.
    listing = {k: ("e", 1) for k in ("tensorrt_llm/1/engine/config.json", "tensorrt_llm/1/engine/rank0.engine",
                                     "tensorrt_llm/1/engine/rank1.engine", "tensorrt_llm/1/stoker_limits.json",
                                     "tensorrt_llm/1/adapters/adapters.json", "tensorrt_llm/config.pbtxt",
                                     "preprocessing/1/tokenizer/tokenizer.json",
                                     "preprocessing/1/tokenizer/tokenizer_config.json",
                                     "preprocessing/1/tokenizer/stoker_runtime.json",
                                     "postprocessing/1/tokenizer/tokenizer.json", "ensemble/config.pbtxt")}
    version, files = openai_service.pick_assets(listing)
    assert version == 1
    assert files == {"tokenizer.json": "preprocessing/1/tokenizer/tokenizer.json",
                     "tokenizer_config.json": "preprocessing/1/tokenizer/tokenizer_config.json",
                     "stoker_runtime.json": "preprocessing/1/tokenizer/stoker_runtime.json",
                     "stoker_limits.json": "tensorrt_llm/1/stoker_limits.json",
                     "adapters.json": "tensorrt_llm/1/adapters/adapters.json"}
    with pytest.raises(openai_service.OpenAIServiceError):
        openai_service.pick_assets({"tensorrt_llm/1/model.py": ("e", 1)})
