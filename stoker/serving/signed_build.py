"""A build's repository checked against its signature before a backend starts from it (signed builds, issue 51).

The marker beside a build (``stoker-repo.json``) and each object's sha256 metadata are written by whoever can
write the bucket, so they prove nothing against that writer. The signature (``<prefix>/repos/<digest>/model.sig``,
OpenSSF model signing's format: stoker/storage/signature.py) is made with a key the bucket's writers do not hold:
here every object the backend would load is read in full and hashed, and the set must be exactly the signed one,
for exactly the recorded digest. Anything else is refused in one line naming the object, before anything that
serves is touched. A repository mounted from this host (GPU targets) is checked the same way, file by file.

What it does not cover: Triton reads S3 itself after this check, and again at every restart or reload; an object
rewritten in between is not seen here (the next deploy or rollback refuses it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..spec.schema import Spec
from ..storage import s3, signing_keys
from ..storage.digest import tree_records
from ..storage.signature import SignatureRefused, first_difference, verify
from .backend_repo import parse_triton_s3

Log = Callable[[str], None]


def check(spec: Spec, repository_uri: str, digest: str, log: Log) -> bool:
    """Refuse (SignatureRefused, one line) a repository that is not the signed build ``digest``; True when it was
    verified, False when verification is off (no public key configured: `stoker plan` says so).

    Raises:
        SignatureRefused: no signature, a bad one, one for another build, or an object that differs from it.
        KeyRefused, SpecError: the configured key cannot be read.
        S3Unreachable, S3Error: S3 could not be read.
    """
    key = signing_keys.public_key(spec.signing)
    if key is None:
        log(f"signature: build {digest[:12]} not verified (no public key: signing.public_key, "
            f"${spec.signing.public_key_env} or a signing key)")
        return False
    st = spec.storage
    client = s3.client(st)
    sig_key = s3.signature_key(st, digest)
    where = f"s3://{st.bucket}/{sig_key}"
    blob = s3.get_bytes(client, st, sig_key)
    if blob is None:
        raise SignatureRefused(f"{where}: build {digest[:12]} is not signed, and a signing key is configured")
    signed = verify(blob, key, where)
    if signed.digest != digest:
        raise SignatureRefused(f"{where}: the signature is for build {str(signed.digest)[:12]}, not {digest[:12]}")
    if repository_uri.startswith("s3://"):
        repo = parse_triton_s3(repository_uri)
        actual: dict[str, str | None] = dict(s3.object_sha256s(client, st.model_copy(update={"bucket": repo.bucket}),
                                                               repo.key))
        shown = f"s3://{repo.bucket}/{repo.key}"
    else:
        folder = Path(repository_uri)
        actual = {r.path: r.sha256 for r in tree_records(folder)}
        shown = str(folder)
    diff = first_difference(signed.files, actual, shown)
    if diff is not None:
        raise SignatureRefused(f"refused: {diff}")
    log(f"signature: build {digest[:12]} verified ({len(actual)} objects at {shown} match {where})")
    return True
