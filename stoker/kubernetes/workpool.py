"""The Prefect Kubernetes work pool that runs the heavy steps (flows/heavy_steps.py) as Jobs asking for GPUs:
a base job template for `prefect work-pool create NAME --type kubernetes --base-job-template FILE`.

Shaped as prefect-kubernetes 0.8.0's default template (prefect_kubernetes/worker.py,
_get_default_job_manifest_template and the KubernetesWorkerJobConfiguration fields), with three changes: GPU limits
(`gpu_count` of `gpu_resource`), a shared-memory volume, and `parallelism`/`completions` in the Job's spec, where
batch/v1 defines them: the default puts them in the pod template's spec, which the API server drops and strict
validation refuses. Pure.
"""

from __future__ import annotations

import copy
import re

from .objects import quantity

_PLACEHOLDER = re.compile(r"^\{\{ (\w+) \}\}$")


def variables(spec) -> dict:
    k = spec.kubernetes
    gpus = spec.parallel.world_size if spec.gpus is not None else 0
    props = {
        "name": {"type": "string", "default": "stoker-heavy-steps", "description": "the Job's name prefix"},
        "namespace": {"type": "string", "default": k.namespace},
        "image": {"type": "string", "default": k.stoker_image,
                  "description": "stoker's worker image (infra/worker/Dockerfile; a GPU host's: the TRT-LLM one)"},
        "image_pull_policy": {"type": "string", "enum": ["IfNotPresent", "Always", "Never"],
                              "default": "IfNotPresent"},
        "service_account_name": {"type": "string", "default": "default"},
        "gpu_resource": {"type": "string", "default": k.gpu_resource},
        "gpu_count": {"type": "integer", "minimum": 0, "default": gpus,
                      "description": "GPUs per heavy-steps Job: the spec's tensor x pipeline"},
        "shm_size": {"type": "string", "default": quantity(spec.deploy.shm_size)},
        "backoff_limit": {"type": "integer", "minimum": 0, "default": 0,
                          "description": "a failed heavy step is not retried by Kubernetes (the flow decides)"},
        "finished_job_ttl": {"type": "integer", "minimum": 0, "default": 3600},
        "pod_watch_timeout_seconds": {"type": "integer", "default": 300},
        "stream_output": {"type": "boolean", "default": True},
    }
    return {"type": "object", "properties": props}


def job_manifest() -> dict:
    limits = {"{{ gpu_resource }}": "{{ gpu_count }}"}
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"generateName": "{{ name }}-", "namespace": "{{ namespace }}",
                     "labels": {"app.kubernetes.io/name": "stoker", "app.kubernetes.io/component": "heavy-steps"}},
        "spec": {
            "parallelism": 1, "completions": 1,  # here, not in the pod spec (see the module's docstring)
            "backoffLimit": "{{ backoff_limit }}", "ttlSecondsAfterFinished": "{{ finished_job_ttl }}",
            "template": {"spec": {
                "restartPolicy": "Never", "serviceAccountName": "{{ service_account_name }}",
                "containers": [{"name": "prefect-job", "image": "{{ image }}",
                                "imagePullPolicy": "{{ image_pull_policy }}",
                                "resources": {"limits": limits},
                                "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}]}],
                "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "{{ shm_size }}"}}],
            }},
        },
    }


def base_job_template(spec) -> dict:
    return {"job_configuration": {"command": "{{ command }}", "env": "{{ env }}", "labels": "{{ labels }}",
                                  "name": "{{ name }}", "namespace": "{{ namespace }}", "job_manifest": job_manifest(),
                                  "cluster_config": "{{ cluster_config }}",
                                  "pod_watch_timeout_seconds": "{{ pod_watch_timeout_seconds }}",
                                  "stream_output": "{{ stream_output }}"},
            "variables": variables(spec)}


def filled_manifest(template: dict) -> dict:
    """The Job the worker would submit with every variable at its default: a placeholder that is a whole string
    (or key) becomes the variable's typed value, as Prefect's templating does; the worker's generateName is given
    as a name (an API server makes one up; validation needs one)."""
    defaults = {k: v.get("default") for k, v in template["variables"]["properties"].items()}

    def fill(node):
        if isinstance(node, dict):
            return {fill(k): fill(v) for k, v in node.items()}
        if isinstance(node, list):
            return [fill(v) for v in node]
        if isinstance(node, str):
            m = _PLACEHOLDER.match(node)
            if m:
                return defaults[m.group(1)]
            return re.sub(r"\{\{ (\w+) \}\}", lambda m: str(defaults[m.group(1)]), node)
        return node

    job = fill(copy.deepcopy(template["job_configuration"]["job_manifest"]))
    job["metadata"]["name"] = job["metadata"].pop("generateName") + "0"
    return job
