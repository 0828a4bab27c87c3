"""The spec's LoRA adapters from the Hub: pinned, checked against the base before any heavy step, fetched like the
base (safetensors only, sha256 per file), and laid into the Triton repository.

Two checks, both before quantize or build: at plan / preflight from each adapter's adapter_config.json alone (a
light read: LoRA only, plain LoRA features, target modules of the base's architecture, rank within lora.max_rank),
and after the fetch from the tensors' shapes (read from the safetensors header, no torch) against the base's
config.json (an adapter made for another base). The rules are stoker/runtime/lora_config.py's, which the runtime
applies again when it loads them.

Task ids: the ensemble's `lora_task_id` (TensorRT-LLM's name for the per-request adapter) of adapter NAME is derived
from NAME alone, so a client's id keeps meaning the same adapter across revisions and rollouts.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

from .errors import PlanRefused
from .runtime.lora_config import CONFIG_FILE, WEIGHTS_FILE, AdapterError, check_against_base, check_shapes, parse_config
from .spec.adapters import Adapter, task_id
from .storage import hub
from .storage.digest import file_sha256, json_digest

TABLE_FILE = "adapters.json"  # in the model's version folder: name → task id, rank, layers, source
FOLDER = "adapters"  # next to the weights in tensorrt_llm/1/


def _token(a: Adapter) -> str | None:
    if a.token_secret:
        from prefect.blocks.system import Secret

        return Secret.load(a.token_secret).get() or None
    return os.environ.get(a.token_env) or None


def _endpoint(spec) -> str:
    from .storage.source import hub_endpoint

    return hub_endpoint(spec.model)


def resolve(spec) -> dict[str, str]:
    """name → the commit sha each adapter's revision points at now (HubError subclasses, one line)."""
    return {a.name: hub.resolve(a.repo_id, a.revision, _endpoint(spec), _token(a)) for a in spec.adapters}


def base_config(spec, fetched: Path | None = None) -> dict:
    """The base's config.json: the fetched folder's, the local checkpoint's, or the Hub's (one light read)."""
    folder = fetched or spec.model.local_path
    if folder is not None:
        return json.loads((Path(folder) / "config.json").read_text())
    from huggingface_hub import hf_hub_download

    from .storage.source import hub_endpoint, hub_token, resolve_source

    sha, _ = resolve_source(spec)
    with tempfile.TemporaryDirectory() as tmp:
        path = hf_hub_download(spec.model.repo_id, "config.json", revision=sha, endpoint=hub_endpoint(spec.model),
                               token=hub_token(spec.model) or False, local_dir=tmp)
        return json.loads(Path(path).read_text())


def check_plan(spec, refusal: Callable[[object, dict], str | None]) -> list[str]:
    """Refuse (PlanRefused, one line) adapters the target cannot serve (``refusal(spec, base config)``: the
    target's reason, or None) or that do not fit the base, from their adapter_config.json; returns a note per
    adapter. Nothing heavy is read."""
    if not spec.adapters:
        return []
    from huggingface_hub import hf_hub_download

    base = base_config(spec)
    reason = refusal(spec, base)
    if reason:
        raise PlanRefused(f"adapters: {reason}")
    shas = resolve(spec)
    notes = []
    with tempfile.TemporaryDirectory() as tmp:
        for a in spec.adapters:
            where = f"adapters: {a.name} ({a.repo_id}@{shas[a.name][:12]})"
            try:
                path = hf_hub_download(a.repo_id, CONFIG_FILE, revision=shas[a.name], endpoint=_endpoint(spec),
                                       token=_token(a) or False, local_dir=Path(tmp) / a.name)
            except Exception as exc:  # noqa: BLE001 - a missing file or a Hub failure: one line either way
                raise PlanRefused(f"{where}: no readable {CONFIG_FILE} ({type(exc).__name__})") from None
            try:
                cfg = parse_config(json.loads(Path(path).read_text()), where)
                check_against_base(cfg, base, spec.lora.max_rank, where)
            except (AdapterError, ValueError) as err:
                raise PlanRefused(str(err)) from None
            notes.append(f"{a.name}: LoRA r={cfg.r} on {', '.join(cfg.target_modules)} from {a.repo_id}@"
                         f"{shas[a.name][:12]} (task id {task_id(a.name)})")
    return notes


def select_files(filenames: list[str], allow_pickle: bool = False) -> list[str]:
    """An adapter's files: its config and its safetensors weights; pickled weights are refused."""
    if CONFIG_FILE not in filenames:
        raise hub.NoSafetensors(f"no {CONFIG_FILE} among {len(filenames)} files: not a PEFT adapter")
    if WEIGHTS_FILE not in filenames:
        pickles = [n for n in filenames if n.endswith(hub.PICKLE_SUFFIXES)]
        if pickles:
            raise hub.PickleRefused(f"adapter weights only as pickle ({', '.join(sorted(pickles)[:2])}); loading "
                                    "them can run code: publish adapter_model.safetensors")
        raise hub.NoSafetensors(f"no {WEIGHTS_FILE} among {len(filenames)} files")
    return [CONFIG_FILE, WEIGHTS_FILE]


# The safetensors format's own bound on its JSON header (the reference reader refuses larger ones): a header size
# read from a crafted file is never allocated beyond it.
MAX_HEADER_BYTES = 100_000_000


def tensor_shapes(path: Path, where: str = "") -> dict[str, tuple[int, ...]]:
    """Tensor name → shape, from a safetensors file's header (no torch, nothing else read); AdapterError (one line)
    for a file that is not one."""
    where = where or path.name
    file_size = path.stat().st_size
    with open(path, "rb") as fh:
        first = fh.read(8)
        if len(first) < 8:
            raise AdapterError(f"{where}: {path.name} is {file_size} bytes, too short for a safetensors header")
        (size,) = struct.unpack("<Q", first)
        if size > min(MAX_HEADER_BYTES, file_size - 8):
            raise AdapterError(f"{where}: {path.name} claims a {size}-byte header in a {file_size}-byte file (at "
                               f"most {MAX_HEADER_BYTES}): not a safetensors file")
        raw = fh.read(size)
    try:
        header = json.loads(raw)
        shapes = {k: tuple(int(n) for n in v["shape"]) for k, v in header.items() if k != "__metadata__"}
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        raise AdapterError(f"{where}: {path.name}'s header is not a safetensors table ({type(err).__name__})") from None
    return shapes


def fetch_all(spec, shas: dict[str, str], base_folder: Path, out: Path, log: Callable[[str], None]) -> dict:
    """Fetch every adapter at its resolved sha into out/NAME (each folder complete or absent), check it against the
    base fetched into ``base_folder``, and describe them; AdapterError (one line) for one that does not fit."""
    base = base_config(spec, base_folder)
    described = {}
    for a in spec.adapters:
        records = hub.fetch(a.repo_id, shas[a.name], _endpoint(spec), _token(a), out / a.name, progress=log,
                            select=select_files)
        where = f"adapter {a.name} ({a.repo_id}@{shas[a.name][:12]})"
        cfg = parse_config(json.loads((out / a.name / CONFIG_FILE).read_text()), where)
        check_against_base(cfg, base, spec.lora.max_rank, where)
        layers = check_shapes(tensor_shapes(out / a.name / WEIGHTS_FILE, where), cfg, base, where)
        described[a.name] = {"repo_id": a.repo_id, "revision": a.revision, "sha": shas[a.name], "r": cfg.r,
                             "alpha": cfg.alpha, "rslora": cfg.use_rslora, "targets": list(cfg.target_modules),
                             "layers": layers, "task_id": task_id(a.name),
                             "files": {r.path: r.sha256 for r in records}}
        log(f"adapter {a.name}: r={cfg.r} on {layers} layers ({', '.join(cfg.target_modules)}), task id "
            f"{task_id(a.name)}")
    return described


def digest(folder: Path) -> str:
    """The content digest of a fetched adapters folder (what the package key takes)."""
    return json_digest({p.relative_to(folder).as_posix(): file_sha256(p)
                        for p in sorted(folder.rglob("*")) if p.is_file()})


def place(folder: Path, described: dict, version_dir: Path) -> None:
    """Copy the adapters into a model's version folder (adapters/NAME/) with the table the model reads."""
    shutil.copytree(folder, version_dir / FOLDER)
    place_table(described, version_dir)


def place_table(described: dict, version_dir: Path) -> None:
    """adapters/adapters.json in a model's version folder: name → task id, rank, source (what the model and the
    OpenAI service name the adapters by)."""
    table = {name: {k: d[k] for k in ("task_id", "r", "alpha", "rslora", "targets", "repo_id", "sha")}
             for name, d in described.items()}
    (version_dir / FOLDER).mkdir(parents=True, exist_ok=True)
    (version_dir / FOLDER / TABLE_FILE).write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
