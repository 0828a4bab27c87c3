"""The one module that talks to a Hugging Face Hub (the real one or our local olah mirror).

Three steps, each usable alone: resolve a revision to a commit sha (pin it), choose which files
of the repo to take (pure), and fetch exactly those files at that sha into a directory that
appears atomically. Every huggingface_hub error is mapped to a HubError subclass with a
one-line message; the access token never appears in a message.
"""

from __future__ import annotations

import glob
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from huggingface_hub import HfApi, RepoFile, snapshot_download
from huggingface_hub import errors as hf_errors
from tqdm.auto import tqdm

from .digest import file_sha256 as sha256_file
from ..errors import StokerError, TransientError
from ..record.progress import Progress

SAFETENSORS_SUFFIXES = (".safetensors", ".safetensors.index.json")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".bin.index.json")
CONFIG_FILES = frozenset({"config.json", "generation_config.json"})
TOKENIZER_FILES = frozenset(
    {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "tokenizer.model",
        "added_tokens.json",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "chat_template.jinja",
        "chat_template.json",
    }
)
# Pickles that trainers leave next to the weights; they are not weights.
TRAINING_STATE_FILES = frozenset({"training_args.bin", "optimizer.pt", "scheduler.pt", "rng_state.pth"})
_FULL_SHA = re.compile(r"^[0-9a-f]{40}$")
_DOWNLOAD_WORKERS = 2  # the machines here share two cores


class HubError(StokerError):
    """Base of every error raised by this module."""


class RepoNotFound(HubError):
    """The repo does not exist, or is private and the token cannot see it."""


class RevisionNotFound(HubError):
    """The repo exists but has no such branch, tag or commit."""


class GatedNeedsToken(HubError):
    """The repo is gated: a token whose user accepted its terms is needed."""


class NoSafetensors(HubError):
    """The repo holds no weight files at all."""


class PickleRefused(HubError):
    """The repo's weights exist only as pickles (.bin/.pt/.pth/.pkl), which can run code when loaded."""


class HubUnavailable(HubError, TransientError):
    """The Hub could not be reached or answered with a server error; retrying may help."""


def _bars_into(progress: Progress) -> type[tqdm]:
    """A tqdm class for snapshot_download that draws nothing and feeds the bytes it counts into `progress`.

    huggingface_hub 2.4 makes three bars of it: files done, network bytes, and bytes written (its
    "Reconstructing" bar, which every file's download updates, rolled back on a retry). The last one
    is the bytes of the files, the total we know from the listing.
    """

    class _Bar(tqdm):
        def __init__(self, *args, **kwargs) -> None:
            self._feeds = str(kwargs.get("desc") or "").startswith("Reconstructing")
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            if self._feeds and n:
                progress.advance(n)
            return None

    return _Bar


@dataclass(frozen=True)
class FileRecord:
    """One fetched file: its repo-relative path, content digest and size."""

    path: str
    sha256: str
    bytes: int


def _scrub(text: str, token: str | None) -> str:
    return text.replace(token, "***") if token else text


def _status(exc: hf_errors.HfHubHTTPError) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def map_error(exc: Exception, repo_id: str, revision: str | None, endpoint: str, token: str | None = None) -> HubError:
    """Translate a huggingface_hub / HTTP exception into our one-line HubError."""
    where = f"{repo_id}@{revision}" if revision else repo_id
    if isinstance(exc, HubError):
        return exc
    if isinstance(exc, hf_errors.GatedRepoError):
        need = "the token has no access; accept its terms on the Hub" if token else "pass a token with access"
        error: HubError = GatedNeedsToken(f"repo {repo_id} is gated: {need}")
    elif isinstance(exc, hf_errors.RevisionNotFoundError):
        error = RevisionNotFound(f"revision {revision!r} not found in repo {repo_id} at {endpoint}")
    elif isinstance(exc, hf_errors.RepositoryNotFoundError):
        hint = "" if token else " (private repos need a token)"
        error = RepoNotFound(f"repo {repo_id} not found at {endpoint}{hint}")
    elif isinstance(exc, hf_errors.OfflineModeIsEnabled):
        error = HubUnavailable(f"cannot reach {endpoint} for {where}: HF_HUB_OFFLINE is set")
    elif isinstance(exc, hf_errors.HfHubHTTPError):
        status = _status(exc)
        if status is None or status >= 500 or status == 429:
            error = HubUnavailable(f"{endpoint} answered HTTP {status} for {where}")
        else:
            error = HubError(f"{endpoint} answered HTTP {status} for {where}")
    elif isinstance(exc, hf_errors.LocalEntryNotFoundError):
        # snapshot_download raises this when the connection fails mid-way.
        error = HubUnavailable(f"cannot download {where} from {endpoint}: connection failed")
    elif isinstance(exc, (hf_errors.HTTPError, ConnectionError, TimeoutError)):
        error = HubUnavailable(f"cannot reach {endpoint} for {where}: {type(exc).__name__}")
    else:
        first_line = (str(exc).splitlines() or [""])[0]
        error = HubError(f"{type(exc).__name__} for {where} at {endpoint}: {first_line}")
    return type(error)(_scrub(str(error), token))


@contextmanager
def _hub_errors(repo_id: str, revision: str | None, endpoint: str, token: str | None) -> Iterator[None]:
    try:
        yield
    except Exception as exc:  # every failure leaves as a HubError, chained for debugging
        raise map_error(exc, repo_id, revision, endpoint, token) from None


def _api(endpoint: str, token: str | None) -> HfApi:
    # token=False (not None) so an ambient HF_TOKEN or cached login is never sent to an
    # endpoint the caller did not hand a token for.
    return HfApi(endpoint=endpoint, token=token or False)


_RESOLVED: ContextVar[dict[tuple[str, str, str], str] | None] = ContextVar("stoker_hub_shas", default=None)


@contextmanager
def resolving_once() -> Iterator[None]:
    """Within it, each (repo, revision, endpoint) is resolved once: every row of one plan names the same commit (a
    branch that moves part way through cannot give the check and a cache key two shas), and the Hub is asked once.
    Outside it every call asks afresh, as a watcher must."""
    token = _RESOLVED.set({})
    try:
        yield
    finally:
        _RESOLVED.reset(token)


def resolve(repo_id: str, revision: str, endpoint: str, token: str | None = None) -> str:
    """The commit sha that revision (branch, tag or sha) of model repo_id points at now (within
    ``resolving_once``: when first asked).

    Example: resolve("org/tiny-llama", "main", "http://127.0.0.1:8090") -> "3f2a...".

    Raises:
        RepoNotFound, RevisionNotFound, GatedNeedsToken, HubUnavailable, HubError.
    """
    if not revision:
        # Without a revision the Hub picks one for us (and olah offline answers 401): always pin.
        raise HubError(f"resolve({repo_id}) needs an explicit revision")
    memo, key = _RESOLVED.get(), (repo_id, revision, endpoint)
    if memo is None:
        return _resolve(repo_id, revision, endpoint, token)
    if key not in memo:
        memo[key] = _resolve(repo_id, revision, endpoint, token)
    return memo[key]


def _resolve(repo_id: str, revision: str, endpoint: str, token: str | None) -> str:
    api = _api(endpoint, token)
    try:
        with _hub_errors(repo_id, revision, endpoint, token):
            sha = api.model_info(repo_id, revision=revision).sha
    except RepoNotFound:
        # A mirror in offline mode (olah) answers "repo not found" for an unknown branch;
        # the refs listing tells a missing repo from a missing revision.
        branches = _branches(api, repo_id)
        if branches is None:
            raise
        raise RevisionNotFound(
            f"revision {revision!r} not found in repo {repo_id} at {endpoint} (branches: {', '.join(branches)})"
        ) from None
    if not sha:
        raise HubError(f"{endpoint} returned no commit sha for {repo_id}@{revision}")
    return sha


def _branches(api: HfApi, repo_id: str) -> list[str] | None:
    """Branch names of repo_id, or None if the repo cannot be seen."""
    try:
        refs = api.list_repo_refs(repo_id)
    except Exception:  # any failure here means: we cannot show the repo exists
        return None
    return sorted(ref.name for ref in refs.branches)


def select_files(filenames: list[str], allow_pickle: bool = False) -> list[str]:
    """The files of a repo needed to load and serve the model: weights, configs, tokenizer.

    Only top-level files count (subfolders hold other formats, e.g. original/*.pth). Safetensors
    weights are taken when present; otherwise pickled weights only with allow_pickle.

    Raises:
        PickleRefused: weights exist only as pickles and allow_pickle is False.
        NoSafetensors: no weight files at all.
    """
    top = [name for name in filenames if "/" not in name]
    safetensors = [n for n in top if n.endswith(SAFETENSORS_SUFFIXES)]
    # Mistral repos ship their native-format consolidated.safetensors next to the HF shards:
    # the same weights twice. Take it only if it is all there is.
    hf_shards = [n for n in safetensors if not n.startswith("consolidated")]
    if hf_shards:
        safetensors = hf_shards
    pickles = [n for n in top if n.endswith(PICKLE_SUFFIXES) and n not in TRAINING_STATE_FILES]
    if safetensors:
        weights = safetensors
    elif pickles and allow_pickle:
        weights = pickles
    elif pickles:
        raise PickleRefused(
            f"weights only as pickle files ({', '.join(sorted(pickles)[:3])}); loading them can run code: "
            "allow pickles explicitly or use a repo with safetensors"
        )
    else:
        raise NoSafetensors(f"no weight files among {len(filenames)} files (no *.safetensors, no pickles)")
    support = [n for n in top if n in CONFIG_FILES or n in TOKENIZER_FILES]
    return sorted(set(weights) | set(support))



def fetch(
    repo_id: str,
    sha: str,
    endpoint: str,
    token: str | None,
    dest: Path,
    allow_pickle: bool = False,
    progress: Callable[[str], None] | None = None,
    select: Callable[..., list[str]] | None = None,
) -> list[FileRecord]:
    """Download the selected files of repo_id at commit sha into dest, which appears complete or not at all.
    ``select`` picks the files from the listing (default select_files: a model's weights, configs, tokenizer).

    Files land in a temp dir next to dest that is renamed to dest at the end; sizes (and the
    sha256 of LFS files) are checked against the Hub's listing.

    Raises:
        HubError: sha is not a full commit sha, dest exists, or a file does not match the listing.
        RepoNotFound, RevisionNotFound, GatedNeedsToken, HubUnavailable: as for resolve.
        PickleRefused, NoSafetensors: as for select_files.
    """
    say = progress or (lambda _message: None)
    if not _FULL_SHA.match(sha):
        raise HubError(f"fetch needs a full 40-hex commit sha (resolve the revision first), got {sha!r}")
    dest = Path(dest)
    if dest.exists():
        raise HubError(f"destination {dest} already exists")
    api = _api(endpoint, token)
    with _hub_errors(repo_id, sha, endpoint, token):
        listing = {
            entry.path: entry
            for entry in api.list_repo_tree(repo_id, revision=sha, recursive=True)
            if isinstance(entry, RepoFile)
        }
    selected = (select or select_files)(sorted(listing), allow_pickle=allow_pickle)
    total = sum(listing[name].size for name in selected)
    say(f"fetching {len(selected)} files ({total / 1e6:.1f} MB) of {repo_id}@{sha[:12]}")

    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    try:
        with _hub_errors(repo_id, sha, endpoint, token), Progress("download", total, "B", say) as bytes_in:
            snapshot_download(
                repo_id,
                revision=sha,
                endpoint=endpoint,
                token=token or False,
                # Escaped: allow_patterns are fnmatch patterns, file names may contain [ ] * ?.
                allow_patterns=[glob.escape(name) for name in selected],
                local_dir=partial,
                max_workers=_DOWNLOAD_WORKERS,
                tqdm_class=_bars_into(bytes_in),
            )
        # huggingface_hub keeps download metadata here; it is not part of the model.
        shutil.rmtree(partial / ".cache", ignore_errors=True)
        records = [_check_file(partial, listing[name], repo_id, sha) for name in selected]
        for record in records:
            say(f"{record.path}: {record.bytes} bytes, sha256 {record.sha256[:12]}")
        partial.rename(dest)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    say(f"fetched {repo_id}@{sha[:12]} into {dest}")
    return records


def _check_file(root: Path, entry: RepoFile, repo_id: str, sha: str) -> FileRecord:
    path = root / PurePosixPath(entry.path)
    if not path.is_file():
        raise HubError(f"{entry.path} missing after download of {repo_id}@{sha[:12]}")
    size = path.stat().st_size
    digest = sha256_file(path)
    if size != entry.size:
        raise HubError(f"{entry.path}: got {size} bytes, the Hub lists {entry.size} ({repo_id}@{sha[:12]})")
    lfs_sha = entry.lfs.sha256 if entry.lfs else None
    if lfs_sha and lfs_sha != digest:
        raise HubError(f"{entry.path}: sha256 {digest[:12]} differs from the Hub's {lfs_sha[:12]}")
    return FileRecord(path=entry.path, sha256=digest, bytes=size)


def signature_file(repo_id: str, sha: str, endpoint: str, token: str | None, name: str = "model.sig") -> bytes | None:
    """The repo's OpenSSF model signature (``model.sig``, a few KB) at commit sha, or None when it carries none.

    Raises RepoNotFound / RevisionNotFound / GatedNeedsToken / HubUnavailable / HubError, one line each.
    """
    from huggingface_hub import hf_hub_download

    with tempfile.TemporaryDirectory(prefix="stoker-sig-") as tmp, _hub_errors(repo_id, sha, endpoint, token):
        try:
            path = hf_hub_download(repo_id, name, revision=sha, endpoint=endpoint, token=token or False,
                                   local_dir=tmp)
        except hf_errors.RemoteEntryNotFoundError:  # the Hub answered 404 for the file (not a failed connection)
            return None
        return Path(path).read_bytes()


def dataset_file(repo_id: str, revision: str, path: str, endpoint: str, dest: Path, token: str | None = None) -> Path:
    """Download one file of a Hub *dataset* repo (evaluation text) into dest; returns its local path.

    Raises RepoNotFound / RevisionNotFound / HubUnavailable / HubError with one line naming the dataset.
    """
    from huggingface_hub import hf_hub_download

    where = f"dataset {repo_id}"
    with _hub_errors(where, revision, endpoint, token):
        return Path(hf_hub_download(repo_id, path, repo_type="dataset", revision=revision, endpoint=endpoint,
                                    token=token or False, local_dir=str(dest)))
