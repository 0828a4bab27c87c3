"""Run one rendered pod on this machine with podman's `kube play` (no Kubernetes API server is obtainable here):
the init container syncs a repository from a local S3 (moto_server) with `stoker sync-repo`, then the CPU Triton
image serves it. Used by benchmarks/k8s_render.py; returns what ran and what was adapted, or why it could not run.

Adaptations of the rendered Deployment, each because podman 4.3 is not a cluster (all listed in the result):
hostNetwork (the local S3 listens on this host's loopback), the Secrets' values inlined (kube play reads only
podman's own secret store), stoker's code of this checkout mounted into the init container (the worker image may
predate `stoker sync-repo`), and Triton's ports moved to free ones. The served repository is a one-model python
echo repository uploaded with stoker's own upload (marker last), not a built LLM: a reference build needs the Hub.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
ECHO_CONFIG = """name: "echo"
backend: "python"
max_batch_size: 0
input [{ name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] }]
output [{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }]
instance_group [{ kind: KIND_CPU count: 1 }]
"""
ECHO_MODEL = """import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(
            r, "INPUT0").as_numpy())]) for r in requests]
"""
ADAPTED = ["hostNetwork: true (the local S3 is on this host's loopback)",
           "Secret values inlined (podman kube play reads only podman's secret store)",
           "this checkout's stoker mounted into the init container (hostPath) and run as python -m stoker.cli",
           "containerPorts dropped (podman turns them into port mappings, refused with host networking)",
           "open-files and process limits kept at this host's hard limits (a containers.conf for the run)",
           "Triton's ports moved to free ones; probes checked from outside (podman 4.3 does not gate on them)"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _podman_images() -> set[str]:
    out = subprocess.run(["podman", "images", "--format", "{{.Repository}}:{{.Tag}}"], capture_output=True,
                         text=True, timeout=60)
    return {line.removeprefix("docker.io/").removeprefix("localhost/") for line in out.stdout.split()}


def why_not() -> str | None:
    """Why the pod cannot run here, or None."""
    if shutil.which("podman") is None:
        return "podman is not installed (apt-get install podman)"
    images = _podman_images()
    for image in ("stoker/worker:0.1.0", "stoker/triton-cpu:2.51.0-cpu"):
        if image not in images:
            return f"{image} is not in podman's image store (podman pull docker-daemon:{image})"
    # The smallest container first: on stoker's machines runc cannot set any container's rlimits.
    probe = subprocess.run(["podman", "run", "--rm", "--ulimit", "host", "stoker/worker:0.1.0", "true"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return (f"{_podman_version()} cannot start any container on this machine, not even `podman run --rm "
                f"--ulimit host IMAGE true`: {last[-160:]} (runc may not set rlimits here: RLIMIT_NOFILE, and "
                "RLIMIT_NPROC once a containers.conf lowers the first; Docker's engine runs containers)")
    return None


def run_pod(timeout_s: float = 180.0) -> dict:
    why = why_not()
    if why:
        return {"ran_here": False, "why": why}
    import yaml

    from stoker.kubernetes import objects, strategy
    from stoker.spec.load import load_spec
    from stoker.stack.s3server import moto_server_bin
    from stoker.storage import s3
    from stoker.storage.digest import records_digest, tree_records

    import os

    # moto accepts any keys; these are the values the pod's Secret would hold, inlined below as well.
    os.environ.update(AWS_ACCESS_KEY_ID="stoker-k8s-key", AWS_SECRET_ACCESS_KEY="stoker-k8s-key")
    work = Path(tempfile.mkdtemp(prefix="stoker-k8s-pod-"))
    s3_port, http, grpc, metrics = (_free_port() for _ in range(4))
    moto = subprocess.Popen([str(moto_server_bin()), "-H", "127.0.0.1", "-p", str(s3_port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pod_file = work / "pod.yaml"
    started = time.monotonic()
    try:
        repo = work / "repo"
        (repo / "echo" / "1").mkdir(parents=True)
        (repo / "echo" / "config.pbtxt").write_text(ECHO_CONFIG)
        (repo / "echo" / "1" / "model.py").write_text(ECHO_MODEL)
        records = tree_records(repo)
        digest = records_digest(records)
        spec_file = work / "spec.yaml"
        spec_file.write_text(yaml.safe_dump({
            "version": 1, "model": {"repo_id": "org/echo"}, "deploy": {"name": "k8s-here", "ports": {
                "http": http, "grpc": grpc, "metrics": metrics}, "ready_timeout_s": 120},
            "storage": {"bucket": "stoker-k8s", "endpoint_url": f"http://127.0.0.1:{s3_port}"},
            "kubernetes": {}}))
        spec = load_spec(spec_file)
        for _ in range(100):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{s3_port}/", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        client = s3.client(spec.storage)
        client.create_bucket(Bucket=spec.storage.bucket)
        s3.upload_tree(client, spec.storage, repo, records, [], digest, lambda _line: None)
        dep = objects.deployment(spec, strategy.derive(spec), "blue", digest)
        pod = dep["spec"]["template"]["spec"]
        pod["hostNetwork"] = True
        pod["containers"][0].pop("ports")  # podman maps containerPorts, which host networking refuses
        init, triton = pod["initContainers"][0], pod["containers"][0]
        for c in (init, triton):
            c["env"] = [e if "value" in e else
                        {"name": e["name"], "value": "stoker-k8s-key" if "AWS" in e["name"] else "admin-token"}
                        for e in c["env"]]
        # The argv_secret shim from this host's build instead of its ConfigMap (kube play reads no ConfigMap here).
        from stoker.containers import argv_secret

        shim = argv_secret.build()
        for volume in pod["volumes"]:
            if volume["name"] == "argv-secret":
                volume.pop("configMap")
                volume["hostPath"] = {"path": str(shim.parent), "type": "Directory"}
        for e in triton["env"]:
            if e["name"] == "LD_PRELOAD":  # the cache folder holds it under its content-keyed name
                e["value"] = f"{objects.SHIM_DIR}/{shim.name}"
        init["command"] = ["python", "-m", "stoker.cli", *init["command"][1:]]
        init["env"] += [{"name": "PYTHONPATH", "value": "/opt/stoker-src"}]
        init["volumeMounts"].append({"name": "stoker-src", "mountPath": "/opt/stoker-src", "readOnly": True})
        pod["volumes"].append({"name": "stoker-src", "hostPath": {"path": str(ROOT), "type": "Directory"}})
        pod_file.write_text(yaml.safe_dump(dep, sort_keys=False))
        # podman raises the containers' open-files limit to its own default, above this host's hard limit (OCI:
        # "error setting rlimit type 7"); a containers.conf of this run's own keeps it at the host's.
        import resource

        files, procs = (resource.getrlimit(r)[1] for r in (resource.RLIMIT_NOFILE, resource.RLIMIT_NPROC))
        conf = work / "containers.conf"
        conf.write_text(f'[containers]\ndefault_ulimits = ["nofile={files}:{files}", "nproc={procs}:{procs}"]\n')
        play = subprocess.run(["podman", "kube", "play", str(pod_file)], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "CONTAINERS_CONF": str(conf)})
        if play.returncode != 0:
            return {"ran_here": False, "why": f"podman kube play failed: {(play.stderr or play.stdout).strip()[-300:]}",
                    "adapted": ADAPTED}
        ready = live = False
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not ready:
            try:
                ready = urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=2).status == 200
            except OSError:
                time.sleep(1)
        if ready:
            live = urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/live", timeout=2).status == 200
        body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [3], "datatype": "FP32", "data": [1, 2, 3]}]})
        answer = None
        if ready:
            req = urllib.request.Request(f"http://127.0.0.1:{http}/v2/models/echo/infer", body.encode(),
                                         {"content-type": "application/json"})
            answer = json.loads(urllib.request.urlopen(req, timeout=10).read())["outputs"][0]["data"]
        admin = {}
        if ready:  # the shim swapped the Secret's token in: Triton's admin API takes it, and refuses the placeholder
            for name, header in (("token", {"stoker-admin": "admin-token"}), ("none", {}),
                                 ("placeholder", {"stoker-admin": argv_secret.PLACEHOLDER})):
                req = urllib.request.Request(f"http://127.0.0.1:{http}/v2/repository/index", b"{}", header,
                                             method="POST")
                try:
                    admin[name] = urllib.request.urlopen(req, timeout=10).status
                except urllib.error.HTTPError as err:
                    admin[name] = err.code
        logs = subprocess.run(["podman", "logs", "k8s-here-blue-pod-sync-repository"], capture_output=True,
                              text=True, timeout=60)
        return {"ran_here": bool(ready and live and answer == [1, 2, 3]), "runtime": _podman_version(),
                "digest": digest, "ready": ready, "live": live, "infer_echo": answer, "admin_index_status": admin,
                "sync_log": (logs.stdout + logs.stderr).strip().splitlines()[-1:],
                "seconds_to_ready": round(time.monotonic() - started, 1), "adapted": ADAPTED,
                "not_run": ["Services, PodDisruptionBudget, HPA, HTTPRoute (podman has no controllers for them)",
                            "GPU limits (no GPU here)", "startup/readiness/liveness probes as kubelet runs them"]}
    finally:
        if pod_file.exists():
            subprocess.run(["podman", "kube", "down", str(pod_file)], capture_output=True, timeout=120)
        moto.terminate()
        moto.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)


def _podman_version() -> str:
    return subprocess.run(["podman", "--version"], capture_output=True, text=True, timeout=30).stdout.strip()


if __name__ == "__main__":
    print(json.dumps(run_pod(), indent=2))
