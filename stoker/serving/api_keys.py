"""API keys of a stable endpoint: read from a file or a Prefect Secret block, checked by the proxy as digests.

The proxy compares the sha256 of the key a request carries (``authorization: Bearer KEY``, the same header as
gRPC metadata) with a file of digests in its own state folder. The keys themselves are never written anywhere:
not in the proxy's config or state, a manifest, a log line or a container's labels or environment. Several keys
serve at once, so a key is rotated by adding the new one, moving clients, then removing the old one; a changed
set reaches the running proxy through its runtime API (``prepare acl`` … ``commit acl``, atomic), no restart.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import StepError
from ..atomic import write_atomic
from ..spec.schema import ApiKeys

DIGESTS_NAME = "api-keys.sha256"
MIN_LENGTH = 16
MAX_LENGTH = 512
MAX_KEYS = 100  # a rotation needs two; the runtime API takes the whole list in one line
# Characters a bearer token may hold (RFC 6750's b64token): no space, comma or quote that a header could split on.
_KEY = re.compile(r"^[A-Za-z0-9._~+/=-]+$")


class ApiKeysError(StepError):
    """The keys' file or block is missing, empty or holds something that is not a usable key."""


@dataclass(frozen=True)
class KeySet:
    """The digests the proxy accepts, and where the keys came from (for messages; never the keys)."""

    digests: tuple[str, ...]
    source: str

    def __len__(self) -> int:
        return len(self.digests)


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def parse(text: str, source: str) -> KeySet:
    """Keys, one per line ('#' comments and blank lines skipped; a JSON list also works) → their digests. Pure.

    A bad line is named by its number, never by its content.
    """
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            lines = [str(k) for k in json.loads(stripped)]
        except (ValueError, TypeError):
            raise ApiKeysError(f"API keys in {source}: not a JSON list of strings") from None
    else:
        lines = text.splitlines()
    digests = []
    for n, line in enumerate(lines, 1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        if not MIN_LENGTH <= len(key) <= MAX_LENGTH or not _KEY.match(key):
            raise ApiKeysError(f"API keys in {source}: entry {n} is not a key ({MIN_LENGTH}–{MAX_LENGTH} characters of "
                               "A-Z a-z 0-9 . _ ~ + / = -)")
        digests.append(digest(key))
    if not digests:
        raise ApiKeysError(f"API keys in {source}: no key (one per line)")
    if len(set(digests)) > MAX_KEYS:
        raise ApiKeysError(f"API keys in {source}: {len(set(digests))} keys, at most {MAX_KEYS}")
    return KeySet(tuple(sorted(set(digests))), source)


def load(keys: ApiKeys) -> KeySet:
    """Read the spec's keys from their file or Prefect Secret block."""
    if keys.file is not None:
        source = f"file {keys.file}"
        try:
            return parse(Path(keys.file).read_text(), source)
        except OSError as err:
            raise ApiKeysError(f"API keys: cannot read {keys.file}: {err.strerror or err}") from None
    source = f"Prefect Secret block {keys.secret_block!r}"
    try:
        from prefect.blocks.system import Secret

        value = Secret.load(keys.secret_block).get()
    except ValueError as err:
        if "Unable to find block document" in str(err):
            raise ApiKeysError(f"API keys: no {source} (create it: prefect block create secret)") from None
        raise ApiKeysError(f"API keys: {source} could not be read: {str(err).splitlines()[0]}") from None
    return parse(json.dumps(value) if isinstance(value, list) else str(value), source)


def publish(state_dir: Path, keys: KeySet | None) -> None:
    """The digests where the proxy reads them (its state folder); without keys, no file."""
    path = state_dir / DIGESTS_NAME
    if keys is None:
        path.unlink(missing_ok=True)
        return
    state_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(path, "".join(f"{d}\n" for d in keys.digests))


def runtime_commands(acl_file: str, version: str, digests: tuple[str, ...]) -> str:
    """Replace the running proxy's key list in one transaction (HAProxy ≥ 2.4). Pure."""
    adds = [f"add acl @{version} {acl_file} {d}" for d in digests]
    return "; ".join([*adds, f"commit acl @{version} {acl_file}"])


def parse_acl_entries(text: str) -> set[str]:
    """``show acl FILE`` → the entries' values. Pure."""
    out = set()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].startswith("0x"):
            out.add(parts[1])
    return out


def parse_prepare(text: str) -> str:
    """``prepare acl FILE`` answers ``New version created: N``. Pure."""
    m = re.search(r"New version created:\s*(\d+)", text)
    if not m:
        raise ApiKeysError(f"the proxy did not open a new key list version: {text.strip()[:120]}")
    return m.group(1)



def sync(sock: Path, acl_file: str, keys: KeySet) -> bool:
    """Make the running proxy accept exactly ``keys``; True when its list had to change."""
    from . import haproxy

    if parse_acl_entries(haproxy.command(sock, f"show acl {acl_file}")) == set(keys.digests):
        return False
    version = parse_prepare(haproxy.command(sock, f"prepare acl {acl_file}"))
    haproxy.command(sock, runtime_commands(acl_file, version, keys.digests))
    return True


# ---------------------------------------------------------------- day-2: change the source, push at once
# `stoker keys` (stoker/commands/keys.py) edits the keys where the spec keeps them, then pushes the new digests to
# the running proxy with sync(): a revoked key is refused within seconds, without a pipeline run or a restart.

GENERATED_BYTES = 32  # token_urlsafe(32): 43 characters, all of them in _KEY
MIN_DIGEST_PREFIX = 8  # what `stoker keys list` prints is longer; shorter would too often name several keys


def generate() -> str:
    import secrets

    return secrets.token_urlsafe(GENERATED_BYTES)


def check_key(key: str) -> None:
    """One line, never naming the key, when ``key`` is not one the proxy could check."""
    if not MIN_LENGTH <= len(key) <= MAX_LENGTH or not _KEY.match(key):
        raise ApiKeysError(f"not a key: {MIN_LENGTH}–{MAX_LENGTH} characters of A-Z a-z 0-9 . _ ~ + / = -")


def keys_of(text: str) -> list[str]:
    """The keys a file or block holds, in order (parse()'s reading, without the checks). Pure."""
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            return [str(k).strip() for k in json.loads(stripped) if str(k).strip()]
        except (ValueError, TypeError):
            return []
    return [k for line in text.splitlines() if (k := line.strip()) and not k.startswith("#")]


def with_key(text: str, key: str) -> str:
    """``text`` with ``key`` appended, its comments and order kept; a JSON list stays one. Pure."""
    if text.strip().startswith("["):
        return json.dumps([*keys_of(text), key])
    return (text if not text or text.endswith("\n") else text + "\n") + key + "\n"


def without(text: str, keys: set[str]) -> str:
    """``text`` with every line (or JSON entry) holding one of ``keys`` dropped, the rest as it was. Pure."""
    if text.strip().startswith("["):
        return json.dumps([k for k in keys_of(text) if k not in keys])
    return "".join(line for line in text.splitlines(keepends=True) if line.strip() not in keys)


def select(keys: list[str], which: str) -> set[str]:
    """The keys ``which`` names: the whole key, or a prefix of its digest (as `stoker keys list` prints it). One line,
    never a key, when it names none or several. Pure."""
    if which in keys:
        return {which}
    w = which.lower()
    if len(w) < MIN_DIGEST_PREFIX or not re.fullmatch(r"[0-9a-f]+", w):
        raise ApiKeysError(f"no such key; name one by the whole key or by {MIN_DIGEST_PREFIX}+ hex characters of "
                           "its digest (stoker keys SPEC list)")
    hits = {k for k in keys if digest(k).startswith(w)}
    if not hits:
        raise ApiKeysError(f"no key whose digest starts with {w} (stoker keys SPEC list)")
    if len({digest(k) for k in hits}) > 1:
        raise ApiKeysError(f"{len(hits)} keys' digests start with {w}: give more of it")
    return hits


def read_source(keys: ApiKeys) -> str:
    """The source's text as it is (the file's lines, or the block's value as load() reads it)."""
    if keys.file is not None:
        try:
            return Path(keys.file).read_text()
        except FileNotFoundError:
            return ""  # `stoker keys add` may make the file
        except OSError as err:
            raise ApiKeysError(f"API keys: cannot read {keys.file}: {err.strerror or err}") from None
    from prefect.blocks.system import Secret

    try:
        value = Secret.load(keys.secret_block).get()
    except ValueError as err:
        if "Unable to find block document" in str(err):
            return ""
        raise ApiKeysError(f"API keys: Prefect Secret block {keys.secret_block!r} could not be read: "
                           f"{str(err).splitlines()[0]}") from None
    return json.dumps(value) if isinstance(value, list) else str(value)


def write_source(keys: ApiKeys, text: str) -> None:
    """Replace the source's keys: the file atomically, mode 0600 (a reader sees the old list or the new, never half);
    the Secret block by one save."""
    if keys.file is not None:
        try:
            write_atomic(Path(keys.file), text)  # mkstemp: 0600
        except OSError as err:
            raise ApiKeysError(f"API keys: cannot write {keys.file}: {err.strerror or err}") from None
        return
    from prefect.blocks.system import Secret

    value = json.loads(text) if text.strip().startswith("[") else text
    Secret(value=value).save(keys.secret_block, overwrite=True)


def source_name(keys: ApiKeys) -> str:
    return f"file {keys.file}" if keys.file is not None else f"Prefect Secret block {keys.secret_block!r}"


def edit_lock(keys: ApiKeys):
    """Two `stoker keys` at once on one file must not lose an edit: an exclusive lock beside it (the kernel drops it
    with its holder). A block's save is one call; no lock."""
    import contextlib
    import fcntl

    if keys.file is None:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def held():
        lock_path = Path(keys.file).with_name(f".{Path(keys.file).name}.lock")
        with open(lock_path, "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield

    return held()


def accepted(sock: Path, acl_file: str) -> set[str]:
    """The digests the running proxy accepts now."""
    from . import haproxy

    return parse_acl_entries(haproxy.command(sock, f"show acl {acl_file}"))
