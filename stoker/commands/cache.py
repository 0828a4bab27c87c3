"""`stoker cache ls|prune [--spec SPEC]`: the step cache's local layer ($STOKER_HOME/cache) and, with a spec whose
bucket holds the shared layer, its S3 layer (`<prefix>/cache/`).

prune removes entries older than --older-than and/or beyond the --keep-last newest per step and layer, never one a
live deployment serves (stoker/cache/prune.py says how that is known), and sweeps what killed steps left.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from ..errors import StokerError


class CacheCommandError(StokerError):
    """Bad prune arguments."""


def local_rows(root: Path) -> list:
    from ..cache.prune import Row

    rows = []
    for rec_path in sorted(root.glob("*/*/record.json")):
        try:
            rec = json.loads(rec_path.read_text())
        except (OSError, ValueError):
            continue
        rows.append(Row("local", rec_path.parent.parent.name, rec_path.parent.name,
                        sum(f.get("bytes", 0) for f in rec.get("files", [])), float(rec.get("created_at", 0)),
                        rec.get("digest")))
    return rows


def remote_rows(s3c, storage) -> tuple[list, list]:
    """Complete remote entries as rows (their markers read for the digest), and the unfinished folders."""
    from ..cache import remote
    from ..cache.prune import Row
    from ..storage.s3 import get_json

    rows, unfinished = [], []
    for f in remote.listing(s3c, storage):
        if not f.has_marker:
            unfinished.append(f)
            continue
        rec = get_json(s3c, storage, f"{remote.entry_prefix(storage, f.step, f.key)}/{remote.RECORD}") or {}
        # The marker's own upload time: finer than LastModified's whole seconds, so ties order as locally.
        created = rec.get("uploaded_at") if isinstance(rec.get("uploaded_at"), (int, float)) else f.newest
        rows.append(Row("remote", f.step, f.key, f.bytes, float(created), rec.get("digest")))
    return rows, unfinished


def size_text(n: float) -> str:
    """Bytes for a person: 512 B, 1.5 MB (decimal units, as `du --si`); `stoker cache` and `stoker prune` print it."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _age(s: float) -> str:
    s = max(0, int(s))
    return f"{s // 86400}d{s % 86400 // 3600:02d}h" if s >= 86400 else (
        f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s")


def _layers(args):
    """(local rows, remote rows, unfinished remote folders, storage, s3 client) for the command's arguments."""
    from ..run import stoker_home
    from ..spec.load import load_spec

    home = stoker_home()
    local = local_rows(home / "cache")
    if not args.spec:
        return home, local, [], [], None, None
    from ..storage import s3

    storage = load_spec(args.spec).storage
    client = s3.client(storage)
    remote, unfinished = remote_rows(client, storage)
    return home, local, remote, unfinished, storage, client


def _served(home: Path):
    from ..cache import prune

    found = prune.served(home)
    for note in found.notes:
        print(f"note: {note}")
    return found


def ls(args) -> int:
    from ..cache import prune

    home, local, remote, unfinished, storage, _ = _layers(args)
    found = _served(home)
    by_key: dict[tuple[str, str], list] = {}
    for r in prune.mark(local + remote, found):
        by_key.setdefault((r.step, r.key), []).append(r)
    now = time.time()
    print(f"{'STEP':<10} {'KEY':<24} {'SIZE':>9} {'AGE':>7}  {'WHERE':<13} SERVED")
    for (step, key), rs in sorted(by_key.items()):
        where = "local+remote" if len(rs) > 1 else rs[0].layer
        print(f"{step:<10} {key:<24} {size_text(max(r.bytes for r in rs)):>9} {_age(now - max(r.created for r in rs)):>7}  "
              f"{where:<13} {'yes' if any(r.served for r in rs) else '-'}")
    for f in unfinished:
        state = "building" if f.has_lease else "unfinished"
        print(f"{f.step:<10} {f.key:<24} {size_text(f.bytes):>9} {_age(now - f.newest):>7}  {'remote':<13} - ({state})")
    if storage is None:
        print(f"local layer {home / 'cache'}; pass --spec to list the S3 layer too")
    else:
        print(f"local layer {home / 'cache'}; S3 layer s3://{storage.bucket}/{storage.prefix}/cache/")
    return 0


def _remove_local(root: Path, step: str, key: str) -> None:
    """Rename out of the key's place first (atomic: no reader sees half an entry), then delete."""
    path = root / step / key
    trash = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-pruned-", dir=path.parent))
    os.rename(path, trash / key)
    shutil.rmtree(trash, ignore_errors=True)


def prune_cmd(args) -> int:
    from ..cache import prune, remote, sweep

    try:
        older = prune.parse_age(args.older_than) if args.older_than is not None else None
        if args.keep_last is not None and args.keep_last < 0:
            raise ValueError("--keep-last must be 0 or more")
        home, local, remote_r, unfinished, storage, client = _layers(args)
        found = _served(home)
        doomed = prune.select(prune.mark(local + remote_r, found), time.time(), older, args.keep_last)
    except ValueError as err:
        raise CacheCommandError(str(err)) from None
    verb = "would remove" if args.dry_run else "removing"
    listed = {(f.step, f.key): f for f in (remote.listing(client, storage) if client is not None else [])}
    removed = 0
    for r in doomed:
        f = listed.get((r.step, r.key))
        if r.layer == "remote" and (f is None or f.has_lease):  # gone meanwhile, or someone is rebuilding it
            print(f"kept remote {r.step}/{r.key}: {'a lease is held on it' if f else 'already gone'}")
            continue
        print(f"{verb} {r.layer} {r.step}/{r.key} ({size_text(r.bytes)})")
        removed += 1
        if args.dry_run:
            continue
        if r.layer == "local":
            _remove_local(home / "cache", r.step, r.key)
        else:
            remote.delete(client, storage, f)
    kept = sum(1 for r in prune.mark(local + remote_r, found) if r.served)
    swept = []
    for parent in sorted(p for p in (home / "cache").glob("*") if p.is_dir()):
        swept += sweep.sweep_local(parent, dry_run=args.dry_run)
    for p in swept:
        print(f"{'would remove' if args.dry_run else 'removed'} leftover {p}")
    if client is not None:
        remote.sweep_remote(client, storage, storage.cache_lease_s, print, dry_run=args.dry_run)
    print(f"{removed} entries {'to remove' if args.dry_run else 'removed'}, {kept} served kept"
          + (" (dry run: nothing removed)" if args.dry_run else ""))
    return 0


def register(sub) -> None:
    p = sub.add_parser("cache", help="list or prune the step cache (local, and S3 with --spec)")
    csub = p.add_subparsers(dest="cache_cmd", required=True)
    p_ls = csub.add_parser("ls", help="every entry: step, key, size, age, where, served by a live deployment")
    p_ls.add_argument("--spec", default=None, help="a spec whose bucket holds the shared cache")
    p_ls.set_defaults(fn=ls)
    p_pr = csub.add_parser("prune", help="remove old entries, never what a live deployment serves")
    p_pr.add_argument("--spec", default=None, help="a spec whose bucket holds the shared cache")
    p_pr.add_argument("--older-than", default=None, metavar="AGE", help="e.g. 7d, 12h, 30m")
    p_pr.add_argument("--keep-last", type=int, default=None, metavar="N", help="keep the N newest per step")
    p_pr.add_argument("--dry-run", action="store_true", help="say what would go, remove nothing")
    p_pr.set_defaults(fn=prune_cmd)
