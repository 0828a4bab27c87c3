"""A run of benchmarks/operate.py: the deployment it promotes builds into (``Run``: spec, builds, deploys, phases,
what serves) and the poll of ready proxy servers during a phase (``ReadyPoll``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "integration"))
from stream_clients import KEY_ENV, auth_headers, request_values  # noqa: E402 -- after sys.path


class Run:
    def __init__(self, state: Path) -> None:
        import boto3

        from stoker.containers.ports import Ports
        from stoker.spec.load import parse_spec
        from stoker.stack.s3server import ensure_s3, s3_env
        from stoker.stack.services import free_port

        self.state = state
        os.environ["STOKER_HOME"] = str(state / "home")
        s3_url = ensure_s3(state)
        os.environ.update({k: v for k, v in s3_env(s3_url).items() if k != "AWS_ENDPOINT_URL"})
        a = free_port()
        b = free_port(exclude=(a,))
        listen = Ports(a, b, free_port(exclude=(a, b)))
        self.data = {
            "model": {"local_path": str(state)},
            "storage": {"bucket": f"operate-{uuid.uuid4().hex[:8]}", "prefix": "op", "endpoint_url": s3_url,
                        "create_bucket": True},
            "deploy": {"name": f"op-{uuid.uuid4().hex[:6]}", "ports": {"http": listen.http, "grpc": listen.grpc,
                                                                      "metrics": listen.metrics},
                       "settle_s": 1, "watch_s": 3, "drain_timeout_s": 15, "ready_timeout_s": 60},
        }
        if os.environ.get("STOKER_OPERATE_REPLICAS"):
            self.data["deploy"]["replicas"] = int(os.environ["STOKER_OPERATE_REPLICAS"])
        if os.environ.get("STOKER_STANDIN"):  # --target tensorrt|pytorch: what a GPU spec says, the stand-in replaces
            self.data.update(model={"repo_id": "meta-llama/Meta-Llama-3-8B-Instruct"},
                             target=os.environ.get("STOKER_OPERATE_TARGET", "tensorrt"),
                             gpus={"type": "h100-80gb", "count": 2,
                                   "rollout": os.environ.get("STOKER_OPERATE_GPU_ROLLOUT", "surge")})
            self.data["deploy"].update(image="nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3", openai=False)
        if os.environ.get(KEY_ENV):
            keys = state / "api-keys.txt"
            keys.write_text(f"operate-old-{uuid.uuid4().hex}\n{os.environ[KEY_ENV]}\n")
            self.data["deploy"]["api_keys"] = {"file": str(keys)}
        self.spec = parse_spec(self.data, "operate")
        # The stand-in is recorded per build (stoker/gpu/standin.py), never read from the environment at deploy.
        self.standin = bool(os.environ.get("STOKER_STANDIN")) and self.spec.target != "reference"
        self.s3 = boto3.client("s3", endpoint_url=s3_url, region_name="us-east-1")
        self.s3.create_bucket(Bucket=self.spec.storage.bucket)
        self.phases: list[dict] = []
        self.runs = 0

    def spec_for(self, rollout: str = "replace", **deploy):
        from stoker.spec.load import parse_spec

        return parse_spec({**self.data, "deploy": {**self.data["deploy"], "rollout": rollout, **deploy}}, "operate")

    def build(self, tag: str, **model) -> tuple[str, str]:
        from serving_models import write_llmapi_repo, write_repo

        from stoker.storage import s3

        root = self.state / "repos" / f"{tag}-{uuid.uuid4().hex[:6]}"
        if self.spec.target == "pytorch":  # the llmapi layout: one `tensorrt_llm` with the LLM API's contract
            write_llmapi_repo(root, tag, **model)
        else:
            write_repo(root, tag, full_layout=True, **model)
        from stoker.storage.digest import records_digest, tree_records

        digest = records_digest(tree_records(root))  # the upload step's digest of a repository
        # As the upload step does for every target: the repository, then its completion marker (what rollback
        # and a GPU backend's mount read back from S3).
        s3.upload_tree(self.s3, self.spec.storage, root, tree_records(root), [], digest, lambda _l: None)
        if self.spec.target != "reference":  # a GPU target's backend mounts the package step's folder
            return str(root), digest
        prefix = f"{s3.repo_prefix(self.spec.storage, digest)}/model_repository"
        return s3.triton_uri(self.spec.storage, prefix), digest

    def deploy(self, tag: str, rollout: str = "replace", **model) -> dict:
        """What `stoker run` does after upload: stage, (gates), switch; and the run manifest rollback reads."""
        from stoker.deploy import rollout as ro
        from stoker.atomic import write_atomic

        spec = self.spec_for(rollout)
        uri, digest = self.build(tag, **model)
        self.runs += 1
        run_id = f"20261123T{self.runs:06d}-{tag.lower()}"
        staged = ro.stage(spec, uri, digest, run_id, self.log, standin=self.standin)
        done = ro.go_live(spec, staged, self.log)
        manifest = {"run_id": run_id, "status": "completed", "spec": spec.model_dump(mode="json"),
                    "standin": {"ran": self.standin},  # what stoker run records; rollback reads it
                    "steps": {"upload": {"status": "completed", "digest": digest, "detail": {"repository_uri": uri}},
                              "deploy": {"status": "completed"}, "switch": {"status": "completed"},
                              # rollback returns only to gated builds; these scripted ones have no benchmark to gate
                              "gate": {"status": "completed", "detail": {"note": "scripted build: no gate to run"}}}}
        write_atomic(Path(os.environ["STOKER_HOME"]) / "runs" / run_id / "manifest.json", json.dumps(manifest))
        return {"staged": {k: staged.get(k) for k in ("reused", "in_place", "version")}, **done}

    def log(self, line: str) -> None:
        if not line.startswith("[stoker-"):  # Triton's own lines: not this script's story
            print(f"    {line}", flush=True)

    def serving(self) -> tuple[str | None, dict | None]:
        from stoker.commands.status import status

        d = status(self.spec.deploy.name)[0]
        tag = None
        try:
            import urllib.request

            model, values = request_values(1, text="x", http=True)
            req = urllib.request.Request(f"{d['endpoint']['http']}/v2/models/{model}/generate_stream",
                                         data=json.dumps(values).encode(), headers=auth_headers())
            with urllib.request.urlopen(req, timeout=10) as r:
                tag = json.loads(r.read().decode().split("data:", 1)[1])["text_output"].split(":")[0]
        except Exception as exc:  # noqa: BLE001 - recorded as no answer
            tag = f"no answer ({type(exc).__name__})"
        return tag, d["endpoint"]

    def phase(self, name: str, fn, expect_error: bool = False) -> dict:
        print(f"[{name}]", flush=True)
        t0 = time.time()
        rec: dict = {"phase": name, "start": t0}
        poll = ReadyPoll(self.spec) if self.spec.deploy.replicas > 1 else None
        try:
            rec["result"] = fn()
            rec["outcome"] = "ok"
        except Exception as exc:  # noqa: BLE001 - a fault phase expects one; its cause is the result
            rec["outcome"] = "error"
            rec["cause"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        rec["end"] = time.time()
        if poll is not None:
            rec["fewest_ready_servers"] = poll.done()
        rec["serving_after"], rec["endpoint_after"] = self.serving()
        if self.spec.target != "reference":  # the GPU set each running backend holds (surge alternates them)
            from stoker.containers import engine

            rec["gpus_after"] = [c.labels.get("ai.stoker.gpus") for c in
                                 engine.containers(engine.connect(), self.spec.deploy.name, role=engine.ROLE_BACKEND)
                                 if c.status == "running"]
        rec["as_expected"] = (rec["outcome"] == "error") == expect_error
        print(f"  -> {rec['outcome']} {rec.get('cause', '')} | serving {rec['serving_after']}", flush=True)
        self.phases.append(rec)
        return rec


class ReadyPoll:
    """The fewest proxy http servers taking new requests (ready, not draining) seen while a phase runs."""

    def __init__(self, spec) -> None:
        from stoker.deploy import rollout

        self.target, self.fewest, self.stop = rollout.target_for(spec), None, threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        from stoker.containers import engine
        from stoker.serving import haproxy, promote

        client = engine.connect()
        while not self.stop.is_set():
            try:
                rt = promote.runtime_for(self.target, promote.proxy_container(client, self.target.name))
                n = sum(1 for s in rt.servers().get("http", {}).values() if s.ready)
                self.fewest = n if self.fewest is None else min(self.fewest, n)
            except (haproxy.ProxyApiError, OSError, AttributeError):
                pass  # the proxy-kill phase: no runtime to read
            time.sleep(0.05)

    def done(self) -> int | None:
        self.stop.set()
        self.thread.join(timeout=5)
        return self.fewest
