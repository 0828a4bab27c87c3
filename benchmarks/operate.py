"""Promotion under load, through the stable endpoint: every request counted; writes JSON.

    .venv/bin/python benchmarks/operate.py [OUT.json] [--no-dockerd-restart] [--keys]
                                           [--target tensorrt|pytorch] [--replicas N] [--rollouts-only]
    (default OUT: benchmarks/results/operate.json, with --keys operate_keys.json, with --target tensorrt
    operate_tensorrt_standin.json, with --target pytorch operate_pytorch_standin.json, with --replicas N
    operate_replicas_N.json; ~6 min on 2 cores)

--rollouts-only: the load and the rollouts (replace x3, switch to reload, reload x3, rollback), no faults (~4 min;
default OUT operate_busy_streams.json): the busy stream's figures per phase (issue 31 item 5).

--replicas N: deploy.replicas N (reference target): N backends behind the address; each phase also records the
fewest proxy servers taking new requests seen during it (polled every 50 ms); the S3 `reload` phases do not apply.

--gpu-rollout surge|shared|reload (with --target): the spec's gpus.rollout (default surge): under shared both
backends hold the same GPUs, under reload the live backend drains and stops before the candidate starts (the
endpoint answers 503 meanwhile: those requests fail, counted). Default OUT operate_<target>_standin_<rollout>.json.

--target tensorrt: the deployment is a `target: tensorrt` spec (2 GPUs listed, gpus.rollout surge) on the STAND-IN
(STOKER_STANDIN=1): its backends are those the tensorrt target supplies (the stand-in image, the serve command, the
repository mounted from a folder, the GPU set per backend, labelled; device requests dropped) serving the same
scripted models. Not TensorRT-LLM: it measures stoker's serving path for that target. The S3 `reload` phases do
not apply (a GPU backend mounts its repository); the rest runs as for the reference target.

--target pytorch: the same on the STAND-IN for a `target: pytorch` spec (TensorRT-LLM's LLM API, the `llmapi`
layout; issue 30 "Measure"): its backends serve one decoupled python model, `tensorrt_llm`, with the contract of
TensorRT-LLM's llmapi model (the config stoker renders, scripted like the ensemble: "<tag>:<i> " per token, the same
fault modes; tests/integration/serving_models.py write_llmapi_repo), and every client speaks the LLM API's
interface (stoker/protocol.py LLMAPI: text_input, streaming, sampling_param_max_tokens, the whole text so far in
each response; STOKER_OPERATE_INTERFACE=llmapi for the load process). Not TensorRT-LLM: stoker's serving path for
that target (smoke inference, watch, retire's unload of `tensorrt_llm`, the proxy) under the same load.

--keys: the deployment asks for an API key (deploy.api_keys, a file of two keys): every client sends one,
so the side-by-side latency is the proxy checking keys, and the load's requests all pass the check.

Real servers only: moto S3, Docker, the CPU Triton image, the HAProxy proxy. The served model is the
promotion tests' tiny `ensemble` (tests/integration/serving_models.py: 4 streamed responses per request,
each naming its build, in TensorRT-LLM's four-model layout so `reload` has every model to load).

1. Side by side, before any load: the same 1-token streamed request straight to the backend and through
   the proxy, interleaved, over HTTP (keep-alive, SSE) and gRPC (one stream per request): p50 added latency.
2. Load for the whole run, in its own process: 2 gRPC clients (one persistent channel each, a stream per
   request), 1 gRPC client keeping one bidi stream open and sending a request every 0.3 s on it (reconnecting
   when a retire ends it between requests), 2 HTTP keep-alive SSE clients, each looping one streamed request
   after another through the stable endpoint (tests/integration/stream_clients.py).
   A request fails on any error; a stream that ends with fewer than 4 responses is truncated.
3. Meanwhile: 3x replace, a switch to reload + 3x reload in place, 1x `stoker rollback`, then each fault of
   issue 11: a candidate ready-then-exiting, never ready, failing its smoke inference; an internal port
   taken; SIGKILL of a deploy midway then a rerun; the proxy killed; dockerd restarted mid-deploy.
   Each phase records its window, its outcome (one line), what serves afterwards and the endpoint.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "integration"))
from stream_clients import (INTERFACE_ENV, KEY_ENV, TOKENS, auth_headers, grpc_inputs,  # noqa: E402 -- after sys.path
                            load_process, request_values)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from operate_faults import (kill_deploy_midway, kill_proxy, restart_dockerd_mid_deploy,  # noqa: E402
                            take_internal_port)
from operate_run import Run  # noqa: E402


# ---------------------------------------------------------------- side-by-side latency


def added_latency(direct: dict, proxied: dict, n: int = 300) -> dict:
    """p50 of a 1-token streamed request, backend vs proxy, interleaved so both see the same machine."""
    import http.client

    import tritonclient.grpc as grpcclient
    from tritonclient.grpc.aio import InferenceServerClient

    model, values = request_values(1, http=True)  # the served interface's (stream_clients: ensemble or llmapi)
    body = json.dumps(values)
    conns = {}
    for k, ep in (("direct", direct), ("proxy", proxied)):
        host, port = ep["http"].removeprefix("http://").split(":")
        conns[k] = http.client.HTTPConnection(host, int(port), timeout=30)
    http_ms: dict[str, list[float]] = {"direct": [], "proxy": []}
    for i in range(n + 20):
        for k in (("direct", "proxy") if i % 2 else ("proxy", "direct")):
            t0 = time.perf_counter()
            conns[k].request("POST", f"/v2/models/{model}/generate_stream", body,
                             {"Content-Type": "application/json", **auth_headers()})
            raw = conns[k].getresponse().read()
            assert b"text_output" in raw, raw[:200]
            if i >= 20:  # warm-up excluded
                http_ms[k].append((time.perf_counter() - t0) * 1000)

    async def grpc_side() -> dict[str, list[float]]:
        clients = {"direct": InferenceServerClient(direct["grpc"]), "proxy": InferenceServerClient(proxied["grpc"])}
        out: dict[str, list[float]] = {"direct": [], "proxy": []}
        model, inputs = grpc_inputs(grpcclient, 1)
        for i in range(n + 20):
            for k in (("direct", "proxy") if i % 2 else ("proxy", "direct")):
                async def req():
                    yield {"model_name": model, "inputs": inputs}

                t0 = time.perf_counter()
                async for _result, error in clients[k].stream_infer(req(), headers=auth_headers() or None):
                    assert error is None, error
                    break
                if i >= 20:
                    out[k].append((time.perf_counter() - t0) * 1000)
        for c in clients.values():
            await c.close()
        return out

    grpc_ms = asyncio.run(grpc_side())
    res = {}
    for proto, ms in (("http_sse", http_ms), ("grpc_stream", grpc_ms)):
        d, p = statistics.median(ms["direct"]), statistics.median(ms["proxy"])
        res[proto] = {"requests_each": len(ms["direct"]), "direct_p50_ms": round(d, 3), "proxy_p50_ms": round(p, 3),
                      "added_p50_ms": round(p - d, 3), "target_added_p50_ms": 1.0, "met": p - d <= 1.0}
    return res


# ---------------------------------------------------------------- the run


def start_load(state: Path, endpoint: dict):
    """The load (stream_clients.load_process) in its own process through ``endpoint``, running once it returns;
    (stop event, process, where it writes its records when stopped)."""
    ctx = mp.get_context("spawn")
    stop, ready = ctx.Event(), ctx.Event()
    load_out = state / "load.json"
    loader = ctx.Process(target=load_process, args=(endpoint, stop, str(load_out), ready))
    loader.start()
    ready.wait(60)
    time.sleep(3)
    return stop, loader, load_out


class _Done(Exception):
    """--rollouts-only: the phases after the rollouts are skipped."""


def attribute(records: list, phases: list[dict]) -> None:
    for ph in phases:  # by the request's start: each request counts in exactly one phase
        inside = [r for r in records if ph["start"] <= r[1] < ph["end"]]
        ph["requests"] = len(inside)
        ph["failed"] = sum(1 for r in inside if not r[3] and not r[4])
        ph["truncated"] = sum(1 for r in inside if r[4])
        ph["errors"] = sorted({r[5] for r in inside if r[5]})[:5]
        busy = [r for r in inside if r[0] == "grpc-busy"]
        ph["busy_stream"] = {"requests": len(busy), "failed": sum(1 for r in busy if not r[3] and not r[4]),
                             "truncated": sum(1 for r in busy if r[4]),
                             # an error before any response (records with a response that then failed are truncated)
                             "refused_before_answer": sum(1 for r in busy if r[5] and not r[3] and not r[4]),
                             "errors": sorted({r[5] for r in busy if r[5]})[:3]}
        if isinstance(ph.get("result"), dict) and "retire_s" in ph["result"]:
            ph["busy_stream"]["retire_s"] = ph["result"]["retire_s"]


KNOWN_FLAGS = {"--keys", "--target", "--gpu-rollout", "--replicas", "--rollouts-only", "--no-dockerd-restart"}


def main() -> int:
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)  # the options are read by hand below: say them rather than start a run
        return 0
    unknown = [a for a in sys.argv[1:] if a.startswith("-") and a not in KNOWN_FLAGS]
    if unknown:
        print(f"operate.py: unknown option {unknown[0]} (--help lists them)", file=sys.stderr)
        return 2
    keyed = "--keys" in sys.argv
    if keyed:
        os.environ[KEY_ENV] = f"operate-{uuid.uuid4().hex}"
    target = sys.argv[sys.argv.index("--target") + 1] if "--target" in sys.argv else "reference"
    if target not in ("reference", "tensorrt", "pytorch"):
        print(f"--target {target}: reference, tensorrt or pytorch", file=sys.stderr)
        return 2
    gpu = target != "reference"
    if gpu:
        os.environ["STOKER_STANDIN"] = "1"
        os.environ["STOKER_OPERATE_TARGET"] = target
    if target == "pytorch":
        os.environ[INTERFACE_ENV] = "llmapi"  # every client, the load process's included, speaks the LLM API's
    gpu_rollout = sys.argv[sys.argv.index("--gpu-rollout") + 1] if "--gpu-rollout" in sys.argv else "surge"
    if gpu_rollout not in ("surge", "shared", "reload") or (gpu_rollout != "surge" and not gpu):
        print(f"--gpu-rollout {gpu_rollout}: surge, shared or reload, with --target tensorrt|pytorch", file=sys.stderr)
        return 2
    os.environ["STOKER_OPERATE_GPU_ROLLOUT"] = gpu_rollout
    replicas = int(sys.argv[sys.argv.index("--replicas") + 1]) if "--replicas" in sys.argv else 1
    if replicas > 1:
        os.environ["STOKER_OPERATE_REPLICAS"] = str(replicas)
    args = [a for i, a in enumerate(sys.argv[1:], 1) if sys.argv[i - 1] not in ("--replicas", "--target",
                                                                                 "--gpu-rollout")]
    default = ("operate_busy_streams.json" if "--rollouts-only" in sys.argv
               else f"operate_{target}_standin{'' if gpu_rollout == 'surge' else '_' + gpu_rollout}.json" if gpu else f"operate_replicas_{replicas}.json" if replicas > 1
               else "operate_keys.json" if keyed else "operate.json")
    out = Path(next((a for a in args if not a.startswith("--")), ROOT / "benchmarks" / "results" / default)).resolve()
    with_dockerd = "--no-dockerd-restart" not in sys.argv
    rollouts_only = "--rollouts-only" in sys.argv
    from stoker.spec.schema import Deploy
    from stoker.stack.image import ensure_proxy_image
    from stoker.stack.services import stop_all

    ensure_proxy_image(Deploy().proxy_image, None, lambda _l: None, base=Deploy().image)
    if gpu:
        from stoker.stack.standin_image import ensure_standin_image

        ensure_standin_image(log=lambda _l: None)
    state = Path(tempfile.mkdtemp(prefix="stoker-operate-"))
    run = Run(state)
    t_start = time.time()
    from stoker.containers import engine

    try:
        try:
            first = run.phase("deploy A (first backend)", lambda: run.deploy("A"))
            endpoint = first["endpoint_after"]
            backend = first["result"]["live"]
            try:
                latency = added_latency({"http": backend["http"], "grpc": backend["grpc"]}, endpoint)
            except Exception as exc:  # noqa: BLE001 - recorded: the run's other figures do not depend on it
                latency = {"error": f"{type(exc).__name__}: {exc}", "backend": backend}
            print(f"proxy added latency: {latency}", flush=True)

            stop, loader, load_out = start_load(state, endpoint)
            for tag in ("B", "C", "D"):
                run.phase(f"replace -> {tag}", lambda tag=tag: run.deploy(tag, interval_s=0.005))
            if not gpu and replicas == 1:
                run.phase("switch to reload (reload backend staged)", lambda: run.deploy("E", "reload"))
                for tag in ("F", "G", "H"):
                    run.phase(f"reload -> {tag} (in place)", lambda tag=tag: run.deploy(tag, "reload"))

            def rollback():
                from stoker.commands.rollback import rollback_to

                return rollback_to(run.spec.deploy.name, None, run.log)

            run.phase("stoker rollback (to the previous run)", rollback)
            if rollouts_only:  # --rollouts-only: the busy-stream figures of issue 31 item 5, without the faults
                time.sleep(3)
                raise _Done
            run.phase("fault: candidate ready, then exits", lambda: run.deploy("X1", mode="exit_after", arg=0.5),
                      expect_error=True)
            run.phase("fault: candidate never ready",
                      lambda: (run.data["deploy"].update(ready_timeout_s=8), run.deploy("X2", mode="hang"))[1],
                      expect_error=True)
            run.data["deploy"]["ready_timeout_s"] = 60
            run.phase("fault: smoke inference fails (a model that raises)", lambda: run.deploy("X3", mode="raise"),
                      expect_error=True)
            run.phase("fault: new backend dies in the watch window", lambda: run.deploy("X4", mode="exit_after", arg=3.0),
                      expect_error=True)
            run.phase("fault: internal port taken by another process", lambda: take_internal_port(run, "I"))
            run.phase("fault: SIGKILL of a deploy midway, then a rerun", lambda: kill_deploy_midway(run, "K"))
            run.phase("fault: proxy container killed", lambda: kill_proxy(run))
            if with_dockerd:
                run.phase("fault: dockerd restarted mid-deploy", lambda: restart_dockerd_mid_deploy(run, "R"),
                          expect_error=True)
            time.sleep(3)
        except _Done:
            pass
        stop.set()
        loader.join(120)
        loaded = json.loads(load_out.read_text())
        records, long_stats, busy_stats = loaded["records"], loaded["long_stream"], loaded.get("busy_stream", {})
    finally:
        engine.remove_deployment(engine.connect(), run.spec.deploy.name, lambda _l: None)
        stop_all(state)

    attribute(records, run.phases)
    disruptive = ("fault: proxy container killed", "fault: dockerd restarted mid-deploy")
    rollout_phases = [p for p in run.phases if p["phase"] not in disruptive]
    in_rollouts = [r for r in records if not any(p["start"] <= r[1] < p["end"] for p in run.phases
                                                 if p["phase"] in disruptive)]
    rollouts = [p for p in run.phases if p["phase"].startswith(("replace", "switch to reload", "reload"))]
    switches = [p["result"]["switch_s"] for p in run.phases
                if isinstance(p.get("result"), dict) and p["result"].get("switched") and "switch_s" in p["result"]]
    endpoints = {json.dumps(p["endpoint_after"], sort_keys=True) for p in run.phases}
    data = {
        "added_latency": latency,
        "load": {"clients": {"grpc": 2, "grpc_long_lived_stream": 1, "grpc_busy_stream": 1, "http_sse": 2},
                 "tokens_per_request": TOKENS,
                 "busy_stream": {"gap_between_requests_s": 0.0, "reconnects": busy_stats.get("reconnects", 0),
                                 **{k: sum(1 for r in records if r[0] == "grpc-busy" and f(r)) for k, f in (
                                     ("requests", lambda r: True), ("failed", lambda r: not r[3] and not r[4]),
                                     ("truncated", lambda r: r[4]),
                                     ("refused_before_answer", lambda r: r[5] and not r[3] and not r[4]))}},
                 "backoff_after_failure_s": 0.05,
                 "long_lived_stream": {"gap_between_requests_s": 0.3, "reconnects": long_stats.get("reconnects", 0),
                                       **{k: sum(1 for r in records if r[0] == "grpc-long" and f(r)) for k, f in (
                                           ("requests", lambda r: True), ("failed", lambda r: not r[3] and not r[4]),
                                           ("truncated", lambda r: r[4]))}},
                 "requests": len(records), "failed": sum(1 for r in records if not r[3] and not r[4]),
                 "truncated": sum(1 for r in records if r[4]),
                 "by_protocol": {proto: sum(1 for r in records if r[0] == proto)
                                 for proto in ("grpc", "grpc-long", "grpc-busy", "http")}},
        "targets": {
            "zero_failed_and_truncated_outside_proxy_and_dockerd_kills": {
                "requests": len(in_rollouts), "failed": sum(1 for r in in_rollouts if not r[3] and not r[4]),
                "truncated": sum(1 for r in in_rollouts if r[4]),
                "met": all(r[3] for r in in_rollouts)},
            # issue 31 item 5: per rollout at most one request of the busy stream fails, before any answer; none
            # is cut part-way; retire never waits the drain deadline for it.
            "busy_stream_through_rollouts": {
                "rollouts": len(rollouts), "truncated": sum(p["busy_stream"]["truncated"] for p in rollouts),
                "failed": sum(p["busy_stream"]["failed"] for p in rollouts),
                "most_failed_in_one_rollout": max((p["busy_stream"]["failed"] for p in rollouts), default=0),
                "retire_s": [p["busy_stream"].get("retire_s") for p in rollouts if "retire_s" in p["busy_stream"]],
                "drain_timeout_s": run.spec.deploy.drain_timeout_s,
                "met": all(p["busy_stream"]["truncated"] == 0 and p["busy_stream"]["failed"] <= 1
                           and p["busy_stream"].get("retire_s", 0) < run.spec.deploy.drain_timeout_s
                           for p in rollouts)},
            "endpoint_constant": {"distinct_endpoints": len(endpoints), "met": len(endpoints) == 1},
            "switch_over_s": {"switches": len(switches), "max": max(switches) if switches else None,
                              "median": statistics.median(switches) if switches else None,
                              "met": bool(switches) and max(switches) <= 1.0},
            "proxy_added_p50_ms": ({k: v["added_p50_ms"] for k, v in latency.items()} if "error" not in latency
                                   else latency["error"]),
            **({"never_fewer_than_n_minus_1_ready_in_rollouts": {
                "replicas": replicas,
                "fewest": min((p["fewest_ready_servers"] for p in rollout_phases
                               if p.get("fewest_ready_servers") is not None
                               and p["phase"] != "deploy A (first backend)"), default=None),
                "met": all((p.get("fewest_ready_servers") or 0) >= replicas - 1 for p in rollout_phases
                           if p["phase"] != "deploy A (first backend)")}} if replicas > 1 else {}),
            "every_fault_ended_with_the_old_build_serving": all(p["as_expected"] for p in run.phases),
        },
        "phases": [{k: v for k, v in p.items() if k not in ("start", "end")}
                   | {"seconds": round(p["end"] - p["start"], 2), "from_s": round(p["start"] - t_start, 2)}
                   for p in run.phases],
        "meta": {"machine": f"{platform.node()} ({os.cpu_count()} CPUs)", "wall_s": round(time.time() - t_start, 1),
                 "api_keys": keyed, "target": run.spec.target, "replicas": replicas, "rollouts_only": rollouts_only,
                 "gpu_rollout": gpu_rollout if gpu else None,
                 "standin": (f"STAND-IN (STOKER_STANDIN=1): the {target} target's backends on "
                             "stoker/triton-standin serving scripted models"
                             + (" with the contract of TensorRT-LLM's llmapi model (one `tensorrt_llm`), every client "
                                "speaking the LLM API's interface (text_input, streaming, sampling_param_max_tokens, "
                                "cumulative text)" if target == "pytorch" else "")
                             + "; stoker's serving path for that target, not TensorRT-LLM") if gpu else False,
                 "interface": os.environ.get(INTERFACE_ENV) or "ensemble",
                 "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "note": "switch_over_s is the proxy's runtime-API switch (candidate proven -> new requests routed "
                         "to it). Killing the proxy or restarting dockerd takes the endpoint itself down until "
                         "Docker restarts it: those phases' failures are reported on their own."},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1, sort_keys=True, default=str))
    print(json.dumps(data["targets"], indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
