"""One builder per Kubernetes object of a deployment's colour, each a pure function of the spec (KServe's raw
reconcilers are built the same way): dicts in the API's own shape, written as YAML by stoker/commands/render.py.

Per colour (blue, green): a Deployment (GPU limits, probes on Triton's health routes, an init container that syncs
the build's repository from S3 with `stoker sync-repo`), a Service, a PodDisruptionBudget and, when the spec asks, a
HorizontalPodAutoscaler on Triton's queue time. Beside them: the stable Service, whose selector names the live
colour (the blue/green switch), and a Gateway API HTTPRoute that splits traffic by weight (the canary).
"""

from __future__ import annotations

import math

from .strategy import COLOURS, Strategy

GROUP = "stoker.dev"
SYNC_ROOT = "/var/lib/stoker-sync"  # the init container's view of the repository volume
REPOSITORY = "model_repository"  # the folder sync-repo creates there; Triton mounts it at /models (subPath)
MODELS = "/models"  # where every target's repository sits in the serving container (stoker.gpu.trtllm.C_MODELS)
ADMIN_TOKEN_ENV = "STOKER_ADMIN_TOKEN"  # stoker.containers.argv_secret.VARIABLE
SHIM_FILE = "argv_secret.so"  # the ConfigMap's key, and the file's name in the container
SHIM_DIR = "/usr/lib/stoker-argv-secret"  # stoker.containers.argv_secret.CONTAINER_DIR, as on one host
PROBE_PERIOD_S = 5
_SIZE_UNITS = {"": "", "b": "", "k": "Ki", "m": "Mi", "g": "Gi"}


def labels(spec, colour: str | None = None) -> dict[str, str]:
    out = {"app.kubernetes.io/name": "stoker", "app.kubernetes.io/instance": spec.deploy.name,
           "app.kubernetes.io/managed-by": "stoker"}
    return out | ({f"{GROUP}/colour": colour} if colour else {})


def _meta(spec, name: str, colour: str | None = None, **extra) -> dict:
    return {"name": name, "namespace": spec.kubernetes.namespace, "labels": labels(spec, colour), **extra}


def _selector(spec, colour: str) -> dict[str, str]:
    return {"app.kubernetes.io/instance": spec.deploy.name, f"{GROUP}/colour": colour}


def colour_name(spec, colour: str) -> str:
    return f"{spec.deploy.name}-{colour}"


def quantity(docker_size: str) -> str:
    """Docker's 256m / 2g (binary units) as a Kubernetes quantity: 256Mi / 2Gi (a Kubernetes "m" is milli)."""
    unit = docker_size[-1] if docker_size[-1].isalpha() else ""
    return docker_size.removesuffix(unit) + _SIZE_UNITS[unit]


def serve_argv(spec) -> tuple[list[str], bool]:
    """Triton's argv as one host runs it (the target's serve command, or tritonserver's arguments after the image's
    entrypoint), listening on every pod address instead of loopback (kubelet's probes and the Service reach the pod
    from outside it), with the admin APIs restricted to the token's placeholder: the argv_secret shim swaps the token
    (env, from a Secret) in inside each tritonserver, so it is in no process's command line (a $(VAR) in args would
    be). True when the argv replaces the image's entrypoint."""
    from .. import targets
    from ..containers.engine import restricted_args, triton_args

    fields = targets.get(spec.target).backend(spec, MODELS, ())
    ports = spec.deploy.ports
    extra = [*fields.get("extra_args", []), *restricted_args()]
    command = fields.get("command")
    argv = command(ports, extra) if command else triton_args(MODELS, ports, extra)
    return [a.replace("=127.0.0.1", "=0.0.0.0") for a in argv], command is not None


def argv_secret_configmap(spec) -> str:
    """The ConfigMap holding the argv_secret shim (key SHIM_FILE): `stoker render --kubernetes` writes the file
    beside the objects, and the user creates it (docs/kubernetes.md)."""
    return f"{spec.deploy.name}-argv-secret"


def _probe(path: str, failures: int) -> dict:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": PROBE_PERIOD_S, "failureThreshold": failures}


def _secret_env(name: str, secret: str, key: str) -> dict:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def sync_container(spec, digest: str) -> dict:
    s, k = spec.storage, spec.kubernetes
    secret = k.s3_secret or f"{spec.deploy.name}-s3"
    argv = ["stoker", "sync-repo", f"{SYNC_ROOT}/{REPOSITORY}", "--bucket", s.bucket, "--prefix", s.prefix,
            "--region", s.region, "--digest", digest, *(["--endpoint-url", s.endpoint_url] if s.endpoint_url else [])]
    return {"name": "sync-repository", "image": k.stoker_image, "command": argv,
            "env": [_secret_env("AWS_ACCESS_KEY_ID", secret, "AWS_ACCESS_KEY_ID"),
                    _secret_env("AWS_SECRET_ACCESS_KEY", secret, "AWS_SECRET_ACCESS_KEY")],
            "volumeMounts": [{"name": "repository", "mountPath": SYNC_ROOT}]}


def serving_container(spec, strategy: Strategy) -> dict:
    d, k = spec.deploy, spec.kubernetes
    argv, replaces_entrypoint = serve_argv(spec)
    image = f"{d.image}@{d.image_digest}" if d.image_digest else d.image
    resources = {"limits": {k.gpu_resource: strategy.gpus_per_pod}} if strategy.gpus_per_pod else {}
    return {
        "name": "triton", "image": image, ("command" if replaces_entrypoint else "args"): argv,
        "env": [_secret_env(ADMIN_TOKEN_ENV, f"{d.name}-admin", "token"),
                {"name": "LD_PRELOAD", "value": f"{SHIM_DIR}/{SHIM_FILE}"}],
        "ports": [{"name": "http", "containerPort": d.ports.http}, {"name": "grpc", "containerPort": d.ports.grpc},
                  {"name": "metrics", "containerPort": d.ports.metrics}],
        "resources": resources,
        # Ready within deploy.ready_timeout_s, as on one host; then ready/live as Triton's Helm example checks them.
        "startupProbe": _probe("/v2/health/ready", max(1, math.ceil(d.ready_timeout_s / PROBE_PERIOD_S))),
        "readinessProbe": _probe("/v2/health/ready", 3),
        "livenessProbe": _probe("/v2/health/live", 3),
        "volumeMounts": [{"name": "repository", "mountPath": MODELS, "subPath": REPOSITORY, "readOnly": True},
                         {"name": "shm", "mountPath": "/dev/shm"},
                         {"name": "argv-secret", "mountPath": SHIM_DIR, "readOnly": True}],
    }


def deployment(spec, strategy: Strategy, colour: str, digest: str) -> dict:
    name = colour_name(spec, colour)
    pod_labels = labels(spec, colour) | {f"{GROUP}/digest": digest[:24]}
    body = {
        "selector": {"matchLabels": _selector(spec, colour)},
        "strategy": strategy.deployment_strategy,
        "template": {"metadata": {"labels": pod_labels}, "spec": {
            "initContainers": [sync_container(spec, digest)],
            "containers": [serving_container(spec, strategy)],
            # deploy.drain_timeout_s: how long a stopping pod may finish what it holds, as a retired backend does.
            "terminationGracePeriodSeconds": int(spec.deploy.drain_timeout_s),
            "volumes": [{"name": "repository", "emptyDir": {}},
                        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": quantity(spec.deploy.shm_size)}},
                        # Not optional: without the shim Triton would take the placeholder itself as its key.
                        {"name": "argv-secret", "configMap": {"name": argv_secret_configmap(spec), "defaultMode": 0o444,
                                                              "items": [{"key": SHIM_FILE, "path": SHIM_FILE}]}}],
        }},
    }
    if spec.kubernetes.autoscaling is None:  # with an HPA the replica count is the autoscaler's
        body = {"replicas": spec.deploy.replicas, **body}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(spec, name, colour), "spec": body}


def _service_ports(spec) -> list[dict]:
    p = spec.deploy.ports
    return [{"name": n, "port": v, "targetPort": n, "protocol": "TCP"}
            for n, v in (("http", p.http), ("grpc", p.grpc), ("metrics", p.metrics))]


def colour_service(spec, colour: str) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(spec, colour_name(spec, colour), colour),
            "spec": {"selector": _selector(spec, colour), "ports": _service_ports(spec)}}


def stable_service(spec) -> dict:
    """The deployment's one address: its selector names the live colour; switching it is the blue/green switch."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(spec, spec.deploy.name),
            "spec": {"selector": _selector(spec, spec.kubernetes.live), "ports": _service_ports(spec)}}


def disruption_budget(spec, strategy: Strategy, colour: str) -> dict:
    """Voluntary evictions (node drains) take at most this many pods of a colour at once. 0 for one replica with
    no declared gap: a drain then waits for an operator. A PDB does not limit the Deployment's own rollout."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _meta(spec, colour_name(spec, colour), colour),
            "spec": {"maxUnavailable": strategy.pdb_max_unavailable,
                     "selector": {"matchLabels": _selector(spec, colour)}}}


def autoscaler(spec, colour: str) -> dict:
    a = spec.kubernetes.autoscaling
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": _meta(spec, colour_name(spec, colour), colour),
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                                        "name": colour_name(spec, colour)},
                     "minReplicas": spec.deploy.replicas, "maxReplicas": a.max_replicas,
                     "metrics": [{"type": "Pods", "pods": {"metric": {"name": a.metric},
                                                          "target": {"type": "AverageValue",
                                                                     "averageValue": str(a.queue_time_us)}}}]}}


def http_route(spec) -> dict:
    """The canary: the live colour gets 100 - canary_percent of the requests, the other colour the rest."""
    k = spec.kubernetes
    weights = {c: (100 - k.canary_percent if c == k.live else k.canary_percent) for c in COLOURS}
    return {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": _meta(spec, spec.deploy.name),
            "spec": {"parentRefs": [{"name": k.gateway}],
                     "rules": [{"backendRefs": [{"name": colour_name(spec, c), "port": spec.deploy.ports.http,
                                                 "weight": w} for c, w in weights.items()]}]}}


def render(spec, strategy: Strategy, colour: str, digest: str) -> list[dict]:
    """Every object for ``colour`` serving the build ``digest``, plus the stable Service and the HTTPRoute."""
    # Both colours' Services, whichever colour is rendered: the HTTPRoute and the switch name them, and they hold no GPU.
    out = [deployment(spec, strategy, colour, digest), *(colour_service(spec, c) for c in COLOURS),
           disruption_budget(spec, strategy, colour)]
    if spec.kubernetes.autoscaling is not None:
        out.append(autoscaler(spec, colour))
    out.append(stable_service(spec))
    if spec.kubernetes.gateway is not None:
        out.append(http_route(spec))
    return out
