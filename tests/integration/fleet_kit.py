"""Two serving hosts on this machine for the fleet tests and benchmarks/fleet_rollout.py: the default Docker engine
("east") and a second dockerd ("west": its own unix socket, data root, exec root and pid file, no bridge, since every
stoker container uses host networking), the Triton CPU and proxy images loaded into it with `docker save | docker
load`, and one Prefect process worker per host (its own pool, STOKER_HOME and DOCKER_HOST) running serve_host.

`FleetKit.start` needs a Prefect API (operate_helpers.prefect_api) and the local stack; `stop` removes what the
hosts serve, stops the second dockerd, and leaves the workers to the Prefect stack's stop_all.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from operate_helpers import ROOT, RUN_FLOW, free_base_port, make_spec, prefect_env, wait_online

HOSTS = ("east", "west")
# Its own bridge, not --bridge=none: a dockerd started with --bridge=none deletes the interface docker0 at start
# (seen here: the default engine's bridge vanished, and with it every bridge-networked container's start), so west
# gets a bridge of its own, made before it starts and deleted after it stops.
WEST_ARGS = "--data-root {d}/data --exec-root {d}/exec --pidfile {d}/docker.pid --bridge={bridge} --iptables=false " \
            "--ip-masq=false"



class FleetKit:
    def __init__(self, api, state: Path, local_stack: dict, tmp: Path) -> None:
        self.api, self.state, self.stack, self.tmp = api, state, local_stack, tmp
        # A short folder: the socket's path must fit a unix socket address (108 bytes).
        self.west_dir = Path(tempfile.mkdtemp(prefix="stk-west-", dir="/tmp"))
        self.west = f"unix://{self.west_dir}/docker.sock"
        self.bridge = f"stkw{self.west_dir.name[-6:]}".replace("_", "x")  # an interface name: at most 15 bytes
        self.east = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
        self.env = {**prefect_env(api), **local_stack["aws_env"]}
        self.homes = {h: tmp / f"home-{h}" for h in HOSTS}

    # ------------------------------------------------------------ the second engine
    def start_west(self) -> None:
        if subprocess.run(["ip", "link", "show", self.bridge], capture_output=True).returncode != 0:
            subprocess.run(["ip", "link", "add", self.bridge, "type", "bridge"], check=True, capture_output=True)
        env = {**os.environ, "DOCKER_HOST": self.west, "DOCKERD_PIDFILE": str(self.west_dir / "dockerd.pid"),
               "DOCKERD_LOG": str(self.west_dir / "dockerd.log"),
               "DOCKERD_EXTRA_ARGS": WEST_ARGS.format(d=self.west_dir, bridge=self.bridge)}
        r = subprocess.run(["bash", str(ROOT / "infra" / "dockerd.sh")], env=env, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]

    def load_images(self, images: list[str]) -> None:
        have = subprocess.run(["docker", "-H", self.west, "images", "--format", "{{.Repository}}:{{.Tag}}"],
                              capture_output=True, text=True, check=True).stdout.split()
        missing = [i for i in images if i not in have]
        if missing:
            save = subprocess.Popen(["docker", "save", *missing], stdout=subprocess.PIPE)
            subprocess.run(["docker", "-H", self.west, "load", "-q"], stdin=save.stdout, check=True,
                           capture_output=True, timeout=600)
            assert save.wait(60) == 0

    def stop_west(self) -> None:
        from stoker.stack.dockerd import stop_daemon

        stop_daemon(self.west_dir)

    # ------------------------------------------------------------ Prefect: deployments and workers
    def apply_deployments(self) -> None:
        repo = yaml.safe_load((ROOT / "prefect.yaml").read_text())
        platform, prefect_file = self.tmp / "platform.yaml", self.tmp / "prefect.yaml"
        platform.write_text(yaml.safe_dump({"work_pools": [{"name": f"fleet-{h}"} for h in HOSTS]}))
        deps = [{"name": h, "entrypoint": "flows/serve_host.py:serve_host", "work_pool": {"name": f"fleet-{h}"}}
                for h in HOSTS]
        prefect_file.write_text(yaml.safe_dump({"build": repo["build"], "pull": repo["pull"], "deployments": deps}))
        r = subprocess.run([sys.executable, "-m", "stoker.cli", "deploy-flows", "--platform", str(platform),
                            "--prefect-file", str(prefect_file)], cwd=ROOT, env=self.env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]

    def start_workers(self) -> None:
        from stoker.stack.prefect_stack import ensure_worker

        for h in HOSTS:
            env = {**self.stack["aws_env"], "STOKER_HOME": str(self.homes[h]),
                   "DOCKER_HOST": self.east if h == "east" else self.west}
            ensure_worker(self.state, self.api, f"fleet-{h}", cwd=ROOT, env=env, name=f"fleet-worker-{h}")
        for h in HOSTS:
            wait_online(self.api, f"fleet-{h}")

    def start(self, images: list[str]) -> FleetKit:
        had_docker0 = subprocess.run(["ip", "link", "show", "docker0"], capture_output=True).returncode == 0
        self.start_west()
        # The default engine's bridge survives a second daemon (other tests start bridge-networked containers).
        assert not had_docker0 or subprocess.run(["ip", "link", "show", "docker0"],
                                                 capture_output=True).returncode == 0, "docker0 deleted"
        self.load_images(images)
        self.apply_deployments()
        self.start_workers()
        return self

    # ------------------------------------------------------------ specs and runs
    def spec(self, name: str, threads: int = 1) -> dict:
        """The tiny spec on both hosts, a build per ``threads`` (triton.model_threads), the front proxy on."""
        data = make_spec(self.stack, name)
        data["triton"] = {"model_threads": threads}
        data["storage"].update(shared_cache=True, create_bucket=True)
        data["evaluation"] = {"enabled": False}
        data["deploy"]["openai"] = False
        ports = data["deploy"]["ports"]
        west, front = free_base_port(), free_base_port()
        data["fleet"] = {
            "hosts": [{"name": "east", "docker_host": self.east, "deployment": "serve_host/east", "ports": ports},
                      {"name": "west", "docker_host": self.west, "deployment": "serve_host/west",
                       "ports": {"http": west, "grpc": west + 1, "metrics": west + 2}}],
            "waves": [["east"], ["west"]], "front": {"http": front, "grpc": front + 1},
            # A process worker under the load starts its run in ~60 s on this 2-core machine (process start, imports).
            "start_timeout_s": 300}
        return data

    def run(self, data: dict, home: Path | None = None, timeout: float = 900, background: bool = False):
        env = {**self.env, "STOKER_HOME": str(home or self.tmp / "home-fleet")}
        args = [sys.executable, "-c", RUN_FLOW, json.dumps(data), "fleet"]
        if background:
            return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
        r = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        return parse(r.stdout + r.stderr)

    def serving(self, data: dict) -> dict[str, dict]:
        from stoker.serving import fleet
        from stoker.spec.load import parse_spec

        spec = parse_spec(data, "fleet")
        return {h.name: fleet.serving_now(h, spec.deploy.name) for h in spec.fleet.hosts}

    def host_manifest_done(self, host: str, run_prefix: str | None = None) -> bool:
        runs = self.homes[host] / "runs"
        return any(p.name.endswith(f"-{host}") and (p / "manifest.json").exists()
                   and (run_prefix is None or p.name.startswith(run_prefix)) for p in runs.glob("*")) \
            if runs.exists() else False

    def cleanup(self, name: str) -> None:
        """Every container of ``name`` on both engines, and the fleet's front."""
        from stoker.containers import engine

        for host in (self.east, self.west):
            try:
                engine.remove_deployment(engine.connect(host, timeout_s=10), name, lambda _m: None)
            except Exception:  # noqa: BLE001 - an engine already stopped holds nothing to remove
                pass
        try:
            client = engine.connect(None)
            for c in client.containers.list(all=True, filters={"name": engine.front_name(name)}):
                c.remove(force=True)
        except Exception:  # noqa: BLE001
            pass

    def stop(self) -> None:
        self.stop_west()
        # dockerd leaves its default network namespace's bind mount behind (seen: the folder could not be removed).
        subprocess.run(["umount", str(self.west_dir / "exec" / "netns" / "default")], capture_output=True)
        shutil.rmtree(self.west_dir, ignore_errors=True)
        subprocess.run(["ip", "link", "delete", self.bridge], capture_output=True)


def parse(out: str) -> dict:
    for tag in ("RESULT ", "FAILED "):
        line = next((ln for ln in out.splitlines() if ln.startswith(tag)), None)
        if line:
            return {"ok": tag == "RESULT ", **json.loads(line.removeprefix(tag)), "log": out}
    raise AssertionError(out[-4000:])


def wait_for(cond, timeout_s: float, what: str, step_s: float = 0.5) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        time.sleep(step_s)
