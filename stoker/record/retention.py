"""What `stoker prune` keeps and removes (pure), and how big stoker's state is (`state_size`, for benchmarks).

Everything a run leaves grows without end unless pruned: S3 ``repos/<digest>/`` (uploaded builds) and ``runs/<id>/``
(manifests, reports, rollback records); under $STOKER_HOME ``runs/<id>/``, ``repos/<digest>/`` (copies a GPU backend
mounts), and per deployment ``proxy/<name>/openai/assets/<key>/`` (tokenizer files) with ``backends/<cid>.json``.

Kept for every deployment (``keep`` = N, default 5):
- the live build: what the history says serves (stoker.record.rollbacks.current), what any existing container of
  stoker's is labelled with, and every digest the S3 live repository names (reload mode copies from it);
- its rollback targets: the N newest builds stoker rollback could return to (stoker.commands.rollback.returnable,
  less those a standing rollback marked bad);
- the N newest runs of any outcome (what a failed run left is read while fixing it), and every rollback record still
  in force (it is what refuses a re-run of a rolled-back build).
A build (repository) stays while any kept run of any deployment names it. What no manifest explains (a run still
in flight, another host's upload not recorded yet) stays until it is older than ``grace_s``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from . import rollbacks

DEFAULT_KEEP = 5
DEFAULT_GRACE_S = 24 * 3600.0  # longer than any run: an unrecorded upload this young may belong to one in flight
DIGEST_CHARS = 24  # S3 and $STOKER_HOME/repos name a build by its digest's first 24 characters (stoker.storage.s3)


@dataclass(frozen=True)
class Item:
    """One removable thing: a run folder, a repository, an assets folder or a backend index, in S3 or on disk."""

    where: str  # "s3" or "local"
    kind: str  # "run", "repo", "assets", "backend-index"
    ident: str  # run id, digest[:24], assets key, container id prefix
    location: str  # s3://bucket/key-prefix/ or a path
    bytes: int
    objects: int
    newest: float  # epoch seconds of its newest object or file (grace is judged on it)
    complete: bool = True  # a run folder: holds a readable manifest; a repository: holds its upload marker


@dataclass
class Plan:
    remove: list[Item] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)  # "kind ident" → why (what `--dry-run` explains)

    @property
    def bytes(self) -> int:
        return sum(i.bytes for i in self.remove)

    @property
    def objects(self) -> int:
        return sum(i.objects for i in self.remove)


def _name(m: dict) -> str | None:
    return ((m.get("spec") or {}).get("deploy") or {}).get("name")


def _digest(m: dict) -> str | None:
    d = ((m.get("steps") or {}).get("upload") or {}).get("digest")
    return d[:DIGEST_CHARS] if isinstance(d, str) and d else None


def kept_runs(manifests: list[dict], keep: int) -> dict[str, str]:
    """run id → why it stays, over every manifest known (local and S3, merged). Pure."""
    from ..commands.rollback import returnable_runs

    if keep < 0:
        raise ValueError("--keep must be 0 or more")
    out: dict[str, str] = {}
    names: dict[str | None, list[dict]] = {}
    for m in manifests:
        names.setdefault(_name(m), []).append(m)
    for name, every in names.items():
        every = sorted(every, key=lambda m: m["run_id"])
        if name is None:  # a manifest of a shape this code does not know: not ours to judge
            out |= {m["run_id"]: "no deployment named in it" for m in every}
            continue
        live = rollbacks.current(every)
        bad = rollbacks.bad_builds(every)
        if live:
            for m in reversed(every):
                if rollbacks.switched_to(m) == live and not rollbacks.is_rollback(m):
                    out.setdefault(m["run_id"], f"{name}: built the live build {live[:12]}")
                    break
        targets = [m for m in returnable_runs(every, name)
                   if m["steps"]["upload"]["digest"] not in bad and m["steps"]["upload"]["digest"] != live]
        seen: set[str] = set()
        for m in reversed(targets):
            if len(seen) >= keep:
                break
            if m["steps"]["upload"]["digest"] not in seen:
                seen.add(m["steps"]["upload"]["digest"])
                out.setdefault(m["run_id"], f"{name}: rollback target")
        for m in every[len(every) - keep:] if keep else []:
            out.setdefault(m["run_id"], f"{name}: among the {keep} newest runs")
        for r in rollbacks.standing(every):
            out.setdefault(r["run_id"], f"{name}: rollback record in force")
    return out


def plan(manifests: list[dict], items: list[Item], protected: dict[str, str], keep: int = DEFAULT_KEEP,
         now: float = 0.0, grace_s: float = DEFAULT_GRACE_S) -> Plan:
    """Which run folders and repositories go. ``protected``: digest[:24] → why (a container's label, an S3 live
    state); ``items`` of kind run and repo only. Pure."""
    runs = kept_runs(manifests, keep)
    known = {m["run_id"] for m in manifests}
    digests = {d: f"named by kept run {rid}" for m in manifests if (rid := m["run_id"]) in runs and (d := _digest(m))}
    digests |= {d[:DIGEST_CHARS]: why for d, why in protected.items()}
    recorded = {d for m in manifests if (d := _digest(m))}  # a build some run recorded: no run in flight is making it
    out = Plan()
    for it in sorted(items, key=lambda i: (i.kind, i.ident, i.where)):
        label = f"{it.where} {it.kind} {it.ident}"
        if it.kind == "run":
            why = runs.get(it.ident) or (None if it.ident in known else _young(it, now, grace_s, "no manifest yet"))
        elif it.kind == "repo":
            why = digests.get(it.ident) or (None if it.ident in recorded else _young(it, now, grace_s,
                                                                                      "named by no run yet"))
        else:
            raise ValueError(f"plan() takes runs and repositories, not {it.kind}")
        if why:
            out.kept[label] = why
        else:
            out.remove.append(it)
    return out


def _young(it: Item, now: float, grace_s: float, what: str) -> str | None:
    return f"{what}, younger than the grace period" if now - it.newest < grace_s else None


def openai_litter(indexes: dict[str, str | None], live_assets: set[str], containers: set[str], assets: list[Item],
                  now: float, grace_s: float = DEFAULT_GRACE_S) -> tuple[list[str], list[Item]]:
    """One deployment's OpenAI state: the backend indexes (container id prefix → the assets key it names) of
    containers that no longer exist, and the assets folders that neither live.json, a remaining index, nor the grace
    period (a prefetch writes the folder before its index) keeps. ``containers``: every existing container id. Pure."""
    gone = sorted(cid for cid in indexes if not any(c.startswith(cid) for c in containers))
    named = set(live_assets) | {k for cid, k in indexes.items() if cid not in gone and k}
    doomed = [a for a in assets if a.ident not in named and now - a.newest >= grace_s]
    return gone, doomed


# ---------------------------------------------------------------- measuring (for benchmarks and `stoker prune`)


def tree_size(path: Path) -> tuple[int, int, float]:
    """(bytes, files, newest mtime) of every file under path (itself when a file); (0, 0, 0) when absent."""
    total = files = 0
    newest = 0.0
    if path.is_file():
        st = path.stat()
        return st.st_size, 1, st.st_mtime
    for root, _dirs, names in os.walk(path):
        for n in names:
            try:
                st = os.lstat(os.path.join(root, n))
            except OSError:  # removed while walking
                continue
            total += st.st_size
            files += 1
            newest = max(newest, st.st_mtime)
    if files == 0 and path.exists():
        newest = path.stat().st_mtime
    return total, files, newest


def s3_size(client, bucket: str, prefix: str) -> dict[str, int]:
    """{"objects": N, "bytes": B} of everything under ``prefix`` (one paginated listing)."""
    objects = total = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            objects += 1
            total += o["Size"]
    return {"objects": objects, "bytes": total}


def state_size(home: Path, stores: list[tuple[object, object]] = ()) -> dict:
    """How big stoker's state is: $STOKER_HOME per top-level folder, and each (S3 client, Storage)'s prefix per
    top-level folder (repos, runs, live, cache, deployments). Units in the keys: bytes and counts."""
    home = Path(home)
    local: dict[str, dict[str, int]] = {}
    for child in sorted(home.iterdir()) if home.is_dir() else []:
        b, n, _ = tree_size(child)
        local[child.name] = {"bytes": b, "files": n}
    out = {"home": str(home), "home_bytes": sum(v["bytes"] for v in local.values()),
           "home_files": sum(v["files"] for v in local.values()), "home_by_folder": local, "s3": []}
    for client, storage in stores:
        by: dict[str, dict[str, int]] = {}
        root = f"{storage.prefix}/"
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=storage.bucket, Prefix=root):
            for o in page.get("Contents", []):
                top = o["Key"][len(root):].split("/", 1)[0]
                slot = by.setdefault(top, {"objects": 0, "bytes": 0})
                slot["objects"] += 1
                slot["bytes"] += o["Size"]
        out["s3"].append({"where": f"s3://{storage.bucket}/{root}", "objects": sum(v["objects"] for v in by.values()),
                          "bytes": sum(v["bytes"] for v in by.values()), "by_folder": by})
    return out
