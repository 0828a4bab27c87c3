"""`stoker prune [--dry-run] [--keep N] [--grace AGE] [--spec SPEC]`: bound what runs leave behind.

Removes old S3 ``repos/<digest>/`` and ``runs/<id>/``, and under $STOKER_HOME old ``runs/<id>/``, ``repos/<digest>/``
and the OpenAI service's assets and backend indexes of containers that are gone. What stays, and why, is decided in
stoker/record/retention.py (pure); this module observes (manifests, S3 listings, Docker labels, live states) and
deletes. The buckets read are those the deployments' run manifests here name, plus --spec's.

Deletion order, so that a concurrent reader never takes half of something for whole: run records before the builds
they name (a manifest never points at a removed repository), and inside a repository its upload marker first
(stoker.storage.s3.read_marker then says "no complete upload": a run uploads again rather than reusing it). Local
folders are renamed out of place before they are deleted.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from ..errors import StokerError
from .cache import size_text


class PruneError(StokerError):
    """Bad arguments, or what serves could not be asked (nothing was removed)."""




def _storages(local: list[dict], spec_path: str | None) -> list:
    from ..record import history
    from ..spec.load import load_spec

    given = load_spec(spec_path) if spec_path else None
    names = sorted({n for m in local if (n := ((m.get("spec") or {}).get("deploy") or {}).get("name"))})
    out: dict[str, object] = {}
    for name in names:
        for st in history.storages_of(local, name):
            out.setdefault(st.model_dump_json(), st)
    if given is not None:
        out.setdefault(given.storage.model_dump_json(), given.storage)
    return list(out.values())


def _s3_items(client, storage, kind: str) -> list:
    """One listing of ``<prefix>/<runs|repos>/``, grouped per run id or digest."""
    from ..record.history import MANIFEST
    from ..record.retention import Item
    from ..storage import s3

    root = f"{storage.prefix}/{kind}s/"
    groups: dict[str, dict] = {}
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=storage.bucket, Prefix=root):
            for o in page.get("Contents", []):
                ident, _, rest = o["Key"][len(root):].partition("/")
                g = groups.setdefault(ident, {"keys": [], "bytes": 0, "newest": 0.0})
                g["keys"].append(o["Key"])
                g["bytes"] += o["Size"]
                g["newest"] = max(g["newest"], o["LastModified"].timestamp())
    except Exception as err:  # noqa: BLE001 - classified by s3.failure
        error = s3.failure(err, f"listing s3://{storage.bucket}/{root}", storage)
        if "NoSuchBucket" in str(error):
            return []
        raise error from None
    head = MANIFEST if kind == "run" else s3.MARKER
    return [Item("s3", kind, ident, f"s3://{storage.bucket}/{root}{ident}/", g["bytes"], len(g["keys"]), g["newest"],
                 complete=f"{root}{ident}/{head}" in g["keys"]) for ident, g in groups.items() if ident]


def _live_digests(client, storage) -> dict[str, str]:
    """digest → why, for every digest an S3 live repository (reload mode) names: it copies configs back from them."""
    from ..deploy.rollout import LIVE_STATE
    from ..storage import s3

    root = f"{storage.prefix}/live/"
    out: dict[str, str] = {}
    try:
        keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=storage.bucket, Prefix=root)
                for o in page.get("Contents", []) if o["Key"].endswith(f"/{LIVE_STATE}")]
        for key in keys:
            state = s3.get_json(client, storage, key) or {}
            name = key[len(root):].split("/", 1)[0]
            for d in [state.get("digest"), (state.get("previous") or {}).get("digest"),
                      *(state.get("versions") or {}).values()]:
                if isinstance(d, str) and d and not d.startswith("live-"):
                    out[d] = f"{name}: named by its S3 live repository"
    except ValueError:
        raise PruneError(f"an S3 live state under s3://{storage.bucket}/{root} is not JSON: nothing removed") from None
    except Exception as err:  # noqa: BLE001 - classified by s3.failure
        if "NoSuchBucket" in str(err):
            return out
        raise s3.failure(err, f"reading the live states under s3://{storage.bucket}/{root}", storage) from None
    return out


def _local_items(home: Path) -> list:
    from ..record.retention import Item, tree_size

    out = []
    for kind, folder in (("run", "runs"), ("repo", "repos")):
        for p in sorted((home / folder).glob("*")) if (home / folder).is_dir() else []:
            if p.name.startswith(".") or not p.is_dir():
                continue  # a temp name: something being written (or a rename out of place being deleted)
            b, n, newest = tree_size(p)
            out.append(Item("local", kind, p.name, str(p), b, n, newest,
                            complete=(p / "manifest.json").is_file() if kind == "run" else True))
    return out


def _openai(home: Path, container_ids: set[str], now: float, grace_s: float) -> list:
    """The removable backend indexes and assets folders of every deployment's OpenAI state on this host."""
    from ..record.retention import Item, openai_litter, tree_size

    out = []
    for state in sorted((home / "proxy").glob("*/openai")):
        indexes: dict[str, str | None] = {}
        for p in sorted((state / "backends").glob("*.json")):
            try:
                indexes[p.stem] = str(json.loads(p.read_text()).get("assets", "")).removeprefix("assets/") or None
            except (OSError, ValueError, AttributeError):
                indexes[p.stem] = None
        try:
            live = {str(json.loads((state / "live.json").read_text()).get("assets", "")).removeprefix("assets/")}
        except (OSError, ValueError, AttributeError):
            live = set()
        assets = []
        for p in sorted((state / "assets").glob("*")):
            if p.is_dir() and not p.name.startswith("."):
                b, n, newest = tree_size(p)
                assets.append(Item("local", "assets", p.name, str(p), b, n, newest))
        gone, doomed = openai_litter(indexes, live, container_ids, assets, now, grace_s)
        for cid in gone:
            p = state / "backends" / f"{cid}.json"
            out.append(Item("local", "backend-index", cid, str(p), p.stat().st_size, 1, p.stat().st_mtime))
        out += doomed
    return out


def _remove_local(path: Path) -> None:
    """Rename out of place first (atomic: no reader sees a half folder under its name), then delete."""
    if path.is_file():
        path.unlink(missing_ok=True)
        return
    trash = Path(tempfile.mkdtemp(prefix=f".pruned-{path.name}-", dir=path.parent))
    os.rename(path, trash / path.name)
    shutil.rmtree(trash, ignore_errors=True)


def _remove_s3(client, bucket: str, prefix: str, first: str) -> None:
    """Every object under prefix, ``first`` (the manifest or the upload marker) alone before the rest."""
    from ..storage import s3

    client.delete_object(Bucket=bucket, Key=prefix + first)
    keys = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys += [o["Key"] for o in page.get("Contents", [])]
    s3._delete(client, bucket, keys)
    s3._abort_uploads(client, bucket, prefix)


def gather(home: Path, spec_path: str | None, keep: int, grace_s: float, now: float | None = None):
    """(plan, local items to remove, {location: (client, storage)}) from what is observed now.

    Raises:
        PruneError: Docker does not answer (what serves cannot be known), or S3 refuses a read.
    """
    from ..containers import engine as docker_engine
    from ..record import history, retention
    from ..record.manifest import read_manifests
    from ..storage import s3

    now = time.time() if now is None else now
    local = read_manifests(home)
    try:
        docker = docker_engine.connect(None, timeout_s=10)
        found = docker_engine.containers(docker)
    except StokerError as err:
        raise PruneError(f"cannot tell what serves, nothing removed: {err}") from None
    protected = {c.labels[docker_engine.LABEL_DIGEST]: f"container {c.name} is labelled with it"
                 for c in found if c.labels.get(docker_engine.LABEL_DIGEST)}
    remote: list[dict] = []
    items = _local_items(home)
    where: dict[str, tuple] = {}
    for st in _storages(local, spec_path):
        client = s3.client(st)
        try:
            remote += history.remote_manifests(client, st, skip={m["run_id"] for m in local})
            protected |= {d: why for d, why in _live_digests(client, st).items() if d not in protected}
            for kind in ("run", "repo"):
                for it in _s3_items(client, st, kind):
                    items.append(it)
                    where[it.location] = (client, st)
        except StokerError as err:
            raise PruneError(f"cannot read s3://{st.bucket}/{st.prefix}/, nothing removed: {err}") from None
    p = retention.plan(history.merge(local, remote), items, protected, keep, now, grace_s)
    extra = _openai(home, {c.id for c in found}, now, grace_s)
    return p, extra, where


def prune_cmd(args) -> int:
    from ..cache.prune import parse_age
    from ..record.retention import DEFAULT_GRACE_S
    from ..run import stoker_home

    if args.keep < 0:
        raise PruneError(f"--keep {args.keep}: must be 0 or more")
    try:
        grace_s = parse_age(args.grace) if args.grace is not None else DEFAULT_GRACE_S
    except ValueError:
        raise PruneError(f"--grace {args.grace!r}: expected a number with s, m, h, d or w (e.g. 1d)") from None
    home = stoker_home()
    plan, extra, where = gather(home, args.spec, args.keep, grace_s)
    # Run records first, then the builds they name; inside each, the manifest or the marker first (module doc).
    order = {("local", "run"): 0, ("s3", "run"): 1, ("local", "repo"): 2, ("s3", "repo"): 3,
             ("local", "backend-index"): 4, ("local", "assets"): 5}
    doomed = sorted(plan.remove + extra, key=lambda i: (order[(i.where, i.kind)], i.ident))
    verb = "would remove" if args.dry_run else "removing"
    if args.verbose:
        for label, why in sorted(plan.kept.items()):
            print(f"keep {label}: {why}")
    for it in doomed:
        unit = ("object" if it.where == "s3" else "file") + ("" if it.objects == 1 else "s")
        print(f"{verb} {it.where} {it.kind} {it.location} ({it.objects} {unit}, {size_text(it.bytes)})")
        if args.dry_run:
            continue
        if it.where == "local":
            _remove_local(Path(it.location))
        else:
            from ..record.history import MANIFEST
            from ..storage import s3

            client, st = where[it.location]
            prefix = it.location.removeprefix(f"s3://{st.bucket}/")
            try:
                _remove_s3(client, st.bucket, prefix, MANIFEST if it.kind == "run" else s3.MARKER)
            except Exception as err:  # noqa: BLE001 - one line, and what was removed so far stays removed
                raise PruneError(f"removing {it.location}: {s3.failure(err, 'delete', st)}") from None
    total = sum(i.bytes for i in doomed)
    print(f"{len(doomed)} {'to remove' if args.dry_run else 'removed'} ({sum(i.objects for i in doomed)} objects or "
          f"files, {size_text(total)}); {len(plan.kept)} runs and builds kept"
          + (" (dry run: nothing removed)" if args.dry_run else ""))
    return 0


def register(sub) -> None:
    from ..record.retention import DEFAULT_KEEP

    p = sub.add_parser("prune", help="remove old builds and run records (S3 and $STOKER_HOME), never what serves "
                                     "or what a rollback may return to")
    p.add_argument("--keep", type=int, default=DEFAULT_KEEP, metavar="N",
                   help=f"per deployment, the N newest rollback targets and the N newest runs stay (default "
                        f"{DEFAULT_KEEP}); the live build always does")
    p.add_argument("--grace", default=None, metavar="AGE",
                   help="what no run names yet (one may be in flight) stays this long (default 1d; e.g. 12h)")
    p.add_argument("--spec", default=None, help="also prune this spec's bucket (the runs here name the others)")
    p.add_argument("--dry-run", action="store_true", help="print what would go (count and bytes), remove nothing")
    p.add_argument("-v", "--verbose", action="store_true", help="also print what stays and why")
    p.set_defaults(fn=prune_cmd)
