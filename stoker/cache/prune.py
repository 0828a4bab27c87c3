"""What `stoker cache prune` removes (pure), and what must never go: whatever a live deployment serves.

"Served" is gathered conservatively, since a wrong guess only keeps an entry longer:
- every deployment named in a run manifest under $STOKER_HOME/runs: its newest deployed run (what reconcile and
  rollback treat as current), plus what Docker reports live for it when a daemon answers, plus its S3 live state
  (a reload backend serves the digest named there);
- a served repository digest protects every step key of the runs that uploaded it (fetch → package: what rebuilds
  it) and any entry whose own digest is that digest (a package entry published by another host's run).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from ..record.manifest import read_manifests


@dataclass(frozen=True)
class Row:
    """One entry in one layer."""

    layer: str  # "local" or "remote"
    step: str
    key: str
    bytes: int
    created: float  # epoch seconds: the record's created_at (local) or the marker's LastModified (remote)
    digest: str | None = None
    served: bool = False


@dataclass
class Served:
    keys: set[tuple[str, str]] = field(default_factory=set)  # (step, key)
    digests: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)  # what could not be asked (Docker down, S3 refused)

    def covers(self, row: Row) -> bool:
        return (row.step, row.key) in self.keys or (row.digest is not None and row.digest in self.digests)


def mark(rows: list[Row], served: Served) -> list[Row]:
    return [replace(r, served=served.covers(r)) for r in rows]


def select(rows: list[Row], now: float, older_than_s: float | None, keep_last: int | None) -> list[Row]:
    """The rows to remove, per layer and step: older than `older_than_s` and not among the `keep_last` newest
    (each condition applies when given; at least one must be). A served row is never chosen; it counts among the
    newest it is one of."""
    if older_than_s is None and keep_last is None:
        raise ValueError("give --older-than and/or --keep-last")
    groups: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.layer, r.step), []).append(r)
    out = []
    for (_layer, _step), group in sorted(groups.items()):
        for i, r in enumerate(sorted(group, key=lambda r: (-r.created, r.key))):
            if r.served:
                continue
            if keep_last is not None and i < keep_last:
                continue
            if older_than_s is not None and now - r.created <= older_than_s:
                continue
            out.append(r)
    return out


def parse_age(text: str) -> float:
    """'90s', '30m', '12h', '7d' (or bare seconds) → seconds. Raises ValueError with a one-line cause."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
    t = text.strip().lower()
    try:
        value = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        raise ValueError(f"--older-than {text!r}: expected a number with s, m, h, d or w (e.g. 7d)") from None
    if value < 0:
        raise ValueError(f"--older-than {text!r}: must not be negative")
    return value


def _step_keys(manifest: dict) -> set[tuple[str, str]]:
    return {(name, s["key"]) for name, s in (manifest.get("steps") or {}).items()
            if isinstance(s, dict) and s.get("key") and name != "upload"}


def served(home: Path, docker_live: Callable[[str], str | None] | None = None,
           s3_live: Callable[[dict, str], str | None] | None = None) -> Served:
    """What live deployments serve, from the run manifests under `home`, Docker and the S3 live states.

    `docker_live(name)` and `s3_live(spec_dict, name)` return a live repository digest (or None) and may raise;
    by default they ask the Docker daemon and the spec's bucket. A source that fails is noted, not fatal: the
    manifests alone still protect each deployment's newest deployed run."""
    from ..commands.rollback import deployed_runs

    found = Served()
    manifests = read_manifests(home)
    names = {}
    for m in manifests:
        name = ((m.get("spec") or {}).get("deploy") or {}).get("name")
        if name:
            names[name] = m.get("spec")  # the newest spec of each deployment wins (run ids sort by time)
    docker_live = docker_live or _docker_live()
    s3_live = s3_live or _s3_live
    for name, spec in sorted(names.items()):
        runs = deployed_runs(home, name)
        if runs:
            found.digests.add(runs[-1]["steps"]["upload"]["digest"])
        for what, ask in (("Docker", lambda: docker_live(name)), ("S3 live state", lambda: s3_live(spec, name))):
            try:
                digest = ask()
            except Exception as err:  # noqa: BLE001 - any source may be down; the manifests still protect
                found.notes.append(f"{name}: {what} not asked ({type(err).__name__}: {str(err)[:120]})")
                continue
            if digest and not digest.startswith("live-"):
                found.digests.add(digest)
    for m in manifests:
        upload = (m.get("steps") or {}).get("upload") or {}
        if upload.get("digest") in found.digests:
            found.keys |= _step_keys(m)
    return found


def _docker_live() -> Callable[[str], str | None]:
    state: dict = {}  # connect once, on first use; a daemon that did not answer is not asked again

    def ask(name: str) -> str | None:
        from ..containers import engine as docker_engine
        from ..commands.status import describe

        if "client" not in state:
            try:
                state["client"] = docker_engine.connect(None, timeout_s=5)
            except Exception as err:
                state["client"], state["error"] = None, err
                raise
        if state["client"] is None:
            raise state["error"]
        return describe(state["client"], name)["live_digest"]
    return ask


def _s3_live(spec: dict, name: str) -> str | None:
    from ..deploy import rollout
    from ..storage import s3
    from ..spec.schema import Storage

    storage = Storage.model_validate(spec["storage"])
    return rollout.read_live(s3.client(storage, attempts=2), storage, name).get("digest")
