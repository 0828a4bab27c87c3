"""The typed pipeline spec: one YAML file describes a whole build-and-deploy run.

Every section forbids unknown keys, so a typo is an error instead of a silently
ignored setting. Pure data: the spec names its target, and the registry that knows the targets
(stoker.targets) is handed to validation by whoever reads a spec (stoker.spec.load), never imported here.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Literal, Protocol

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_serializer, model_validator

from .. import target_traits
from ..gpu.sections import Build, Gpus, Parallel, Runtime, check_image_digest
from .adapters import Adapter, Lora, check_names
from .base import RepoId, _Section, _without_defaults
from .fleet import Fleet
from .kubernetes import Kubernetes
# Also imported from here as stoker.spec.schema's sections, though only Spec's fields name two of them.
from .quality import Benchmark, BenchmarkGate, EvalDataset, Evaluation, LmEvalTask  # noqa: F401

# Every format some target runs; which target runs which is the target's answer (stoker/targets/).
QuantFormat = Literal["none", "fp8", "int4_awq", "int8_sq", "w4a8_awq", "nvfp4", "int8_wo", "int4_wo", "fp8_pc_pt"]
KvCacheDtype = Literal["none", "fp8", "int8"]
DEFAULT_TARGET = target_traits.DEFAULT
# The validation context's key for the target lookup: a name → TargetRules, ValueError naming the known targets.
TARGET_LOOKUP = "targets"

_BUCKET = re.compile(r"^[0-9a-z][0-9a-z.-]{1,61}[0-9a-z]$")
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,40}$")


class ModelSource(_Section):
    """Where the weights come from: a Hub repo at a revision, or a local folder."""

    repo_id: RepoId | None = None
    revision: str = "main"
    endpoint: str | None = Field(None, description="Hub endpoint; default: $HF_ENDPOINT or the public Hub")
    token_env: str = Field("HF_TOKEN", description="environment variable holding the Hub token")
    token_secret: str | None = Field(None, description="Prefect Secret block holding the Hub token")
    local_path: Path | None = None
    allow_pickle: bool = Field(False, description="accept .bin/.pt weights (unsafe: pickle)")
    # OpenSSF model signing (stoker/storage/model_signature.py): a model.sig the model carries is verified with this
    # key; keyless Sigstore signatures (certificates, Rekor) cannot be checked offline and are not.
    public_key: Path | None = Field(None, description="PEM public key (EC) of the model's publisher: the fetch "
                                    "verifies the model's model.sig with it")
    require_signature: bool = Field(False, description="refuse a model without a model.sig that verifies with "
                                    "model.public_key, before anything is downloaded but the signature")

    @model_validator(mode="after")
    def _one_source(self) -> ModelSource:
        if (self.repo_id is None) == (self.local_path is None):
            raise ValueError("set exactly one of model.repo_id or model.local_path")
        if self.require_signature and self.public_key is None:
            raise ValueError("model.require_signature needs model.public_key (the publisher's PEM public key)")
        return self

    @model_serializer(mode="wrap")
    def _omit_signature_defaults(self, handler):
        # Left at their defaults, the signature fields stay out of dumps: manifests and the spec digest read as before.
        return _without_defaults(self, handler(self), ("public_key", "require_signature"))


class Calibration(_Section):
    text_file: Path | None = Field(None, description="offline text; default: stoker's bundled calibration.txt")
    samples: int = Field(16, ge=1, le=4096)
    seq_len: int = Field(128, ge=8, le=8192)
    batch_size: int = Field(4, ge=1, le=256)


class Quantization(_Section):
    format: QuantFormat = "none"
    kv_cache_dtype: KvCacheDtype = "none"
    calibration: Calibration = Calibration()

    @model_validator(mode="after")
    def _kv_needs_quant(self) -> Quantization:
        if self.kv_cache_dtype != "none" and self.format == "none":
            raise ValueError("kv_cache_dtype needs a weight format other than 'none'")
        # kv int8 and the GPU-only formats are refused per target in Spec._quant_for_target.
        return self


class Instances(_Section):
    preprocessing: int = Field(1, ge=1, le=64)
    model: int = Field(1, ge=1, le=64)
    postprocessing: int = Field(1, ge=1, le=64)


class Triton(_Section):
    max_batch_size: int = Field(8, ge=1, le=1024)
    instances: Instances = Instances()
    model_threads: int = Field(2, ge=1, le=256, description="torch threads per reference model instance")


class Storage(_Section):
    bucket: str
    prefix: str = "stoker"
    endpoint_url: str | None = Field(None, description="S3 endpoint; default: AWS")
    region: str = "us-east-1"
    create_bucket: bool = Field(False, description="create the bucket when it does not exist")
    # The name only: the keys stay in Prefect (stoker/storage/credentials.py), never in a spec, manifest or log.
    credentials_block: str | None = Field(
        None, description="Prefect AwsCredentials block (prefect-aws) with the S3 keys; default: the environment")
    # Off by default for now: the shared cache adds S3 round trips (lookups, a lease, uploads of every step's
    # output) to each step, and the demo's rerun budget counts on a warm local cache answering in milliseconds.
    shared_cache: bool = Field(False, description="share step results through <prefix>/cache/ in the bucket")
    cache_lease_s: float = Field(120.0, ge=2, le=86400,
                                 description="a builder's lease on a cache key expires this long after its last "
                                             "renewal (it renews every third of it)")
    cache_stall_s: float = Field(1800.0, ge=1, le=86400,
                                 description="a builder whose child process printed nothing for this long stops "
                                             "renewing its lease, so a waiter takes the key over")
    cache_wait_s: float = Field(21600.0, ge=1, le=7 * 86400,
                                description="a waiter gives up, in one line, after waiting this long for another "
                                            "builder of the same key that still renews its lease")

    @field_validator("shared_cache", mode="before")
    @classmethod
    def _shared_cache(cls, v: object) -> object:
        if not isinstance(v, bool):
            raise ValueError(f"must be true or false, not {v!r}")
        return v

    @model_serializer(mode="wrap")
    def _omit_cache_defaults(self, handler):
        # Left at their defaults, the cache fields stay out of dumps: manifests and the spec digest read as before.
        return _without_defaults(self, handler(self), ("shared_cache", "cache_lease_s", "cache_stall_s",
                                                        "cache_wait_s"))

    @field_validator("bucket")
    @classmethod
    def _bucket(cls, v: str) -> str:
        if not _BUCKET.match(v):
            raise ValueError(f"{v!r} is not a valid bucket name ([0-9a-z.-], 3-63 chars)")
        return v

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        v = v.strip("/")
        if not v or ".." in v.split("/"):
            raise ValueError("prefix must be a non-empty relative key prefix")
        return v


class Signing(_Section):
    """Signed builds (stoker/storage/signing_keys.py): the upload signs the repository with the private key, and every
    backend's repository is verified with the public key before the backend starts. Off where no key is configured."""

    # The block's or variable's name only: the key itself never reaches a spec, manifest, artifact or log.
    key_secret: str | None = Field(None, description="Prefect Secret block holding the signing key (EC private key, "
                                   "PEM); default: the file named by key_env")
    key_env: str = Field("STOKER_SIGNING_KEY", description="environment variable naming the signing key's PEM file")
    public_key: Path | None = Field(None, description="PEM public key builds are verified with; default: the file "
                                    "named by public_key_env, else the signing key's own")
    public_key_env: str = Field("STOKER_SIGNING_PUBLIC_KEY", description="environment variable naming the "
                                "verification key's PEM file (a host that serves but does not sign)")


class Routing(_Section):
    """Where the heavy steps (fetch, quantize, build) run. By default in the flow run itself; with `heavy`, as a
    run of a heavy_steps deployment on its own work pool (GPU hosts: a docker or Kubernetes pool), whose results
    reach this run through the shared step cache (flows/heavy_steps.py)."""

    heavy: str | None = Field(None, description="FLOW/DEPLOYMENT of heavy_steps, e.g. heavy_steps/gpu; "
                                                "default: the heavy steps run in this flow run")
    start_timeout_s: float = Field(120.0, gt=0, le=86400, description="a routed run that no worker has started "
                                   "this long after it was scheduled is cancelled; the run fails naming the pool")
    timeout_s: float = Field(7200.0, gt=0, le=604800, description="a routed run still going after this long fails "
                             "the run")

    @field_validator("heavy")
    @classmethod
    def _deployment_name(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[^/\s]+/[^/\s]+", v):
            raise ValueError(f"{v!r} is not FLOW/DEPLOYMENT (e.g. heavy_steps/gpu)")
        return v


class Ports(_Section):
    http: int = Field(8000, ge=1, le=65535)
    grpc: int = Field(8001, ge=1, le=65535)
    metrics: int = Field(8002, ge=1, le=65535)

    @model_validator(mode="after")
    def _distinct(self) -> Ports:
        if len({self.http, self.grpc, self.metrics}) != 3:
            raise ValueError("http, grpc and metrics ports must differ")
        return self


class Ulimit(_Section):
    soft: int
    hard: int


class ApiKeys(_Section):
    """Where the stable endpoint's API keys are: a file or a Prefect Secret block, one key per line (several, for
    rotation). Only their sha256 digests reach the proxy; the keys stay in the file or the block."""

    file: Path | None = Field(None, description="a file of keys, one per line ('#' starts a comment)")
    secret_block: str | None = Field(None, description="a Prefect Secret block holding the keys, one per line "
                                     "(or a JSON list)")

    @model_validator(mode="after")
    def _one_source(self) -> ApiKeys:
        if (self.file is None) == (self.secret_block is None):
            raise ValueError("give api_keys.file or api_keys.secret_block (one of them)")
        return self


class Tls(_Section):
    """TLS at the proxy: PEM files read at deploy; the proxy's copy stays in its own state folder."""

    cert_file: Path = Field(description="the certificate (chain), PEM")
    key_file: Path = Field(description="its private key, PEM")


class Limits(_Section):
    """What the stable endpoint accepts from one client and from all (stoker/serving/edge.py; docs/serving.md,
    "Limits at the endpoint"). Over a bound: 413, 408, 429, or the connection closed as it is accepted."""

    max_body_bytes: int = Field(16 << 20, ge=1024, le=1 << 30, description="the largest request body (413 above)")
    request_timeout_s: int = Field(30, ge=1, le=3600, description="a request's headers and body must arrive within "
                                   "this (408 after); generation streams are not bound by it")
    # At most 8192: HAProxy needs about two file descriptors a connection and refuses to start when its container's
    # open-file limit (Docker's default here: 20000) is under what maxconn asks.
    max_connections: int = Field(4096, ge=16, le=8192, description="connections open at the proxy in all (every "
                                 "port); past it the next ones wait to be accepted")
    max_connections_per_client: int = Field(1024, ge=1, le=100_000, description="connections one client address may "
                                            "hold open (HTTP, gRPC and metrics ports together); the next one is "
                                            "closed as it is accepted")
    max_requests_per_client_per_s: int = Field(0, ge=0, le=100_000, description="requests a second from one client "
                                               "address, averaged over 10 s (429 above); 0: no bound")

    @model_validator(mode="after")
    def _per_client_within_all(self) -> Limits:
        if self.max_connections_per_client > self.max_connections:
            raise ValueError(f"max_connections_per_client {self.max_connections_per_client} is over max_connections "
                             f"{self.max_connections}: one client could never hold that many")
        return self


class Deploy(_Section):
    name: str = "stoker"
    docker_host: str | None = Field(None, description="default: $DOCKER_HOST or the local socket")
    image: str = "stoker/triton-cpu:2.51.0-cpu"
    image_digest: str | None = Field(None, description="sha256:… of the image; pins it beyond its tag")
    ports: Ports = Ports()
    proxy_image: str = Field("stoker/haproxy:2.6", description="the stable endpoint's reverse proxy (HAProxy 2.6)")
    shm_size: str = "256m"
    ulimits: dict[str, Ulimit] = Field(default_factory=dict, description="e.g. memlock: {soft: 8388608, hard: 8388608}")
    ready_timeout_s: float = Field(180, gt=0, le=3600)
    settle_s: float = Field(3.0, ge=0, le=600, description="a candidate must stay ready this long before its smoke "
                            "inference")
    watch_s: float = Field(30.0, ge=0, le=3600, description="after the switch, the old backend stays warm this long "
                           "while the new one is watched; a fault switches traffic back")
    max_error_rate_pct: float = Field(1.0, ge=0, le=100, description="failed requests on the new backend during the "
                                      "watch window, in percent, that switch traffic back")
    watch_min_failures: int = Field(3, ge=1, le=10000, description="the watch window switches back only once one "
                                    "route has at least this many failures that are the build's fault (and a rate "
                                    "over max_error_rate_pct): one failure in a quiet window is not a verdict")
    drain_timeout_s: float = Field(60.0, ge=0, le=3600, description="how long a retired backend may finish the "
                                   "requests it holds")
    rollout: Literal["replace", "reload"] = Field(
        "replace", description="replace: a new backend behind the proxy, proven before it gets traffic; reload: "
        "load the new model version into the live backend (Triton model-control API, no second container)")
    # Read by nothing since reload gates a build on its own candidate first (issue 49): kept so older specs load.
    auto_rollback: bool = Field(True, description="no effect, accepted for older specs: a reload build is gated "
                                "on a candidate of its own before it is loaded, and a failed load or smoke always "
                                "loads the recorded version back")
    # OpenAI-compatible API (issue 14). reference: a service container per deployment behind the proxy's /v1/
    # (stoker.serving.openai_service). tensorrt: Triton's own OpenAI frontend as the serve command, by contract
    # (stoker.gpu.openai_frontend), on the metrics role's port.
    openai: bool = Field(True, description="serve /v1/models, /v1/completions and /v1/chat/completions: on the stable "
                         "HTTP port (target reference), or Triton's OpenAI frontend (target tensorrt)")
    # Where the stable endpoint binds. Loopback unless the spec says otherwise, and an address other machines can
    # reach is refused without keys unless the spec says that too, in as many words (Redis's protected mode).
    # Backends, candidates and the OpenAI service listen on loopback whatever this is.
    listen: str = Field("127.0.0.1", description="the stable endpoint's bind address: 127.0.0.1 (default), 0.0.0.0, "
                        "or one of this host's addresses")
    allow_unauthenticated: bool = Field(False, description="true: serve on a non-loopback deploy.listen with no API "
                                        "key (anyone who reaches the address can use the model)")
    # Checked by the proxy on every route but health (HTTP `authorization: Bearer`, gRPC metadata alike).
    api_keys: ApiKeys | None = Field(None, description="API keys the stable endpoint requires (Bearer)")
    tls: Tls | None = Field(None, description="serve the stable endpoint over TLS (https, gRPC with TLS)")
    # Identical backends behind the one address (HAProxy leastconn), each proven before it joins; a rollout stages
    # all N of the new build beside the old ones and switches them together (surge), so N stay ready throughout.
    replicas: int = Field(1, ge=1, le=16, description="identical backends behind the stable endpoint (leastconn)")
    limits: Limits = Field(Limits(), description="bounds at the stable endpoint: body size, request timeout, "
                           "connections and request rate per client and in all")

    @model_serializer(mode="wrap")
    def _omit_listen_defaults(self, handler):
        # Left at their defaults, the listen fields stay out of dumps: manifests and the spec digest read as before.
        return _without_defaults(self, handler(self), ("listen", "allow_unauthenticated", "api_keys", "tls",
                                                       "replicas", "limits"))

    @model_validator(mode="after")
    def _replicas_replace(self) -> Deploy:
        if self.replicas > 1 and self.rollout == "reload":
            raise ValueError(f"replicas {self.replicas} with rollout reload: an in-place reload loads one backend; "
                             "use rollout replace (the new build's replicas are staged beside the old ones)")
        return self

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        import ipaddress

        try:
            return str(ipaddress.ip_address(v))
        except ValueError:
            raise ValueError(f"{v!r} is not an IP address (127.0.0.1, 0.0.0.0 or one of this host's)") from None

    @model_validator(mode="after")
    def _protected(self) -> Deploy:
        import ipaddress

        if not ipaddress.ip_address(self.listen).is_loopback and not self.allow_unauthenticated and not self.api_keys:
            raise ValueError(f"listen {self.listen} lets other machines reach the endpoint with no API key: set "
                             "deploy.api_keys, keep 127.0.0.1, or set deploy.allow_unauthenticated: true to serve it "
                             "open")
        return self

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"{v!r}: use lowercase letters, digits and '-'")
        return v

    @field_validator("shm_size")
    @classmethod
    def _shm(cls, v: str) -> str:
        if not re.fullmatch(r"\d+[bkmg]?", v):
            raise ValueError(f"{v!r} is not a size like 256m or 1g")
        return v

    @field_validator("image_digest")
    @classmethod
    def _image_digest(cls, v: str | None) -> str | None:
        return check_image_digest(v)


class Spec(_Section):
    """A whole run: model → quantization → target → Triton → storage → deploy → benchmark."""

    version: Literal[1] = 1
    model: ModelSource
    # A module of stoker/targets/ (reference: our CPU runtime; tensorrt: TRT-LLM engine + tensorrtllm
    # backend; pytorch: LLM-API). Before quantization and gpus: their validators ask the target.
    target: str = DEFAULT_TARGET
    quantization: Quantization = Quantization()
    gpus: Gpus | None = Field(None, validate_default=True, description="required for GPU targets")
    parallel: Parallel = Parallel()
    build: Build = Build()
    runtime: Runtime = Runtime()
    triton: Triton = Triton()
    storage: Storage
    deploy: Deploy = Deploy()
    benchmark: Benchmark = Benchmark()
    evaluation: Evaluation = Evaluation()
    routing: Routing = Routing()
    adapters: list[Adapter] = Field(default_factory=list, description="LoRA adapters served beside the base")
    lora: Lora = Lora()
    signing: Signing = Signing()
    kubernetes: Kubernetes | None = Field(None, description="what `stoker render --kubernetes` writes beyond the "
                                          "one-host spec (docs/serving.md#kubernetes)")
    fleet: Fleet | None = Field(None, description="several serving hosts rolled out in waves (docs/serving.md#fleet)")

    def digest(self) -> str:
        return section_digest(self)

    # Validated against the targets only when the context has their lookup (stoker.spec.load gives it): a Spec
    # rebuilt without one (a flow's parameter) is checked by the flow instead.
    @field_validator("target")
    @classmethod
    def _known_target(cls, v: str, info: ValidationInfo) -> str:
        lookup = _lookup(info)
        if lookup is not None:
            lookup(v)
        return v

    @field_validator("quantization")
    @classmethod
    def _quant_for_target(cls, q: Quantization, info: ValidationInfo) -> Quantization:
        target = _target(info)
        if target is not None:
            target.check_quantization(q)
        return q

    @field_validator("gpus")
    @classmethod
    def _gpus_for_target(cls, g: Gpus | None, info: ValidationInfo) -> Gpus | None:
        target = _target(info)
        if target is not None:
            target.check_gpus(g)
        return g

    @model_validator(mode="after")
    def _routed_needs_shared_cache(self) -> Spec:
        if self.routing.heavy and not self.storage.shared_cache:
            raise ValueError("routing.heavy needs storage.shared_cache: true (the routed steps' results reach this "
                             "run through the bucket)")
        if self.routing.heavy and self.model.local_path is not None:
            raise ValueError("routing.heavy needs a Hub model (model.repo_id): the routed run's worker cannot read "
                             "model.local_path")
        return self

    @model_validator(mode="after")
    def _fleet_needs_shared_cache(self) -> Spec:
        if self.fleet and not self.storage.shared_cache:
            raise ValueError("fleet needs storage.shared_cache: true (each host's run reads the one build through "
                             "the bucket)")
        return self

    @model_validator(mode="after")
    def _adapter_names(self) -> Spec:
        # The base's own ids: the ensemble, the engine model, and the id stoker's OpenAI service lists for the base.
        check_names(self.adapters, {"ensemble": "the ensemble's model name", "tensorrt_llm": "the engine model's name",
                                    self.deploy.name: "the deployment's own model id (deploy.name)"})
        return self

    @model_serializer(mode="wrap")
    def _omit_default_routing(self, handler):
        # Left at their defaults, routing, adapters, lora and kubernetes stay out of dumps: manifests and the spec
        # digest read as before.
        out = handler(self)
        if isinstance(out, dict):
            if self.routing == Routing():
                out.pop("routing", None)
            if not self.adapters:
                out.pop("adapters", None)
            if self.lora == Lora():
                out.pop("lora", None)
            if self.signing == Signing():
                out.pop("signing", None)
            if self.kubernetes is None:
                out.pop("kubernetes", None)
            if self.fleet is None:
                out.pop("fleet", None)
        return out


class TargetRules(Protocol):
    """What validation asks of the spec's target (stoker.targets.base.Target); each raises ValueError, one line."""

    def check_quantization(self, q: Quantization) -> None: ...

    def check_gpus(self, gpus: Gpus | None) -> None: ...


def _lookup(info: ValidationInfo) -> Callable[[str], TargetRules] | None:
    return (info.context or {}).get(TARGET_LOOKUP)


def _target(info: ValidationInfo) -> TargetRules | None:
    lookup = _lookup(info)
    # An unknown target has already been reported; the other sections are checked as for the default.
    return None if lookup is None else lookup(info.data.get("target", DEFAULT_TARGET))


def section_digest(section: BaseModel) -> str:
    """sha256 of a section's canonical JSON: the part of every cache key that is config."""
    blob = json.dumps(section.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()
