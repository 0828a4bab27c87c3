"""A model's own OpenSSF signature (``model.sig`` in the Hub repo or the local folder), checked by the fetch.

Before anything but the signature is downloaded: a model without one under ``model.require_signature``, or one whose
signature does not verify with ``model.public_key``, is refused in one line. After the fetch (or its cache hit): every
file the build uses must be listed in the signature with the same sha256. Files the signature lists and the build does
not take (a README, other formats) are not downloaded, so not checked. A keyless Sigstore signature (a Fulcio
certificate, Rekor entries) is checked only as a signature by ``model.public_key``: its identity cannot be checked
offline.
"""

from __future__ import annotations

from typing import Callable

from ..spec.schema import Spec
from . import hub
from .signature import SIGNATURE_NAME, Signed, SignatureRefused, load_public_key, verify
from .signing_keys import read_key_file

Log = Callable[[str], None]


def _where(spec: Spec, source_id: str) -> str:
    m = spec.model
    return str(m.local_path / SIGNATURE_NAME) if m.local_path is not None else \
        f"{m.repo_id}@{source_id[:12]}/{SIGNATURE_NAME}"


def signature_bytes(spec: Spec, source_id: str) -> bytes | None:
    """The model's model.sig, or None when it carries none (a Hub request of a few KB, or a local read)."""
    from .source import hub_endpoint, hub_token

    m = spec.model
    if m.local_path is not None:
        path = m.local_path / SIGNATURE_NAME
        return path.read_bytes() if path.is_file() else None
    return hub.signature_file(m.repo_id, source_id, hub_endpoint(m), hub_token(m))


def check_signature(spec: Spec, source_id: str, log: Log) -> Signed | None:
    """The model's verified signature, or None where there is none to check (and none is required).

    Raises:
        SignatureRefused: required and missing, or present and not verifying with model.public_key.
        KeyRefused: model.public_key is not a PEM EC public key.
    """
    m = spec.model
    if m.public_key is None:  # require_signature needs a key (the spec says so): nothing to check with
        return None
    where = _where(spec, source_id)
    blob = signature_bytes(spec, source_id)
    if blob is None:
        if m.require_signature:
            raise SignatureRefused(f"model.require_signature: {where} does not exist (the model is unsigned)")
        log(f"signature: {where} does not exist; the model is unsigned (model.require_signature is off)")
        return None
    key = load_public_key(read_key_file(m.public_key, "model.public_key"), f"model.public_key ({m.public_key})")
    signed = verify(blob, key, where)
    log(f"signature: {where} verified with model.public_key ({len(signed.files)} files signed)")
    return signed


def check_files(signed: Signed, files: dict[str, str], where: str) -> None:
    """Refuse (one line) a fetched file the signature does not list, or whose sha256 differs from the signed one."""
    for path in sorted(files):
        if path not in signed.files:
            raise SignatureRefused(f"refused: {where}/{path} is not in the model's signature")
        if files[path] != signed.files[path]:
            raise SignatureRefused(f"refused: {where}/{path} differs from the model's signature (sha256 "
                                   f"{files[path][:12]}, signed {signed.files[path][:12]})")

