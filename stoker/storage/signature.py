"""Signatures of a file set in OpenSSF model signing's format (``model.sig``): pure, no I/O.

The format, as the `model-signing` library (sigstore/model-transparency, v1.x) writes it for a key-based signature:
a Sigstore bundle (``application/vnd.dev.sigstore.bundle.v0.3+json``) holding a DSSE envelope over an in-toto
Statement v1 whose predicate (``https://model_signing/signature/v1.0``) lists every file with its sha256; the subject's
digest is the sha256 of those digests in path order; the envelope is signed with ECDSA (P-256/384/521, SHA-256/384/512
by curve) over DSSE's pre-authentication encoding; the bundle's ``publicKey.hint`` is the sha256 of the signer's public
key PEM. A signature stoker makes verifies with ``model_signing.verifying.Config().use_elliptic_key_verifier``, and
stoker verifies the library's.

Why not the library itself: model-signing 1.1.1 pulls in sigstore, tuf, rfc3161-client, in-toto-attestation and
sigstore-models (14 packages) to sign with a local key, and the orchestrator that signs stays light; the format is
small, and `cryptography` (already here) does the ECDSA. Sigstore's keyless flow (a Fulcio certificate for an OIDC
identity, logged in Rekor) needs those services online: stoker neither makes nor fully verifies it. A keyless bundle's
DSSE signature is still checked against the public key stoker is given; its certificate chain and transparency-log
entries are not.

stoker adds one predicate field the v1.0 predicate allows ("other fields are ignored by v1.0 verifiers"):
``stoker.digest``, the build's repository digest (stoker.storage.digest.records_digest), so a genuine signature of
another build, copied beside this one with that build's files, is refused.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from ..errors import StepError
from .digest import FileRecord

SIGNATURE_NAME = "model.sig"
BUNDLE_MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://model_signing/signature/v1.0"
_CURVES = {"secp256r1": hashes.SHA256, "secp384r1": hashes.SHA384, "secp521r1": hashes.SHA512}


class SignatureRefused(StepError):
    """A signature that is missing, malformed, made with another key, or over files that differ (one line)."""


class KeyRefused(StepError):
    """A signing or verification key that is not a usable PEM EC key (one line; never the key itself)."""


@dataclass(frozen=True)
class Signed:
    """What a verified signature vouches for: each file's sha256 by path, and the build digest stoker recorded."""

    files: dict[str, str]
    digest: str | None  # stoker's predicate field; None in a signature stoker did not make
    name: str


def load_private_key(pem: bytes, where: str) -> ec.EllipticCurvePrivateKey:
    """An unencrypted PEM EC private key on a curve model signing supports; KeyRefused naming ``where`` else."""
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except TypeError:
        raise KeyRefused(f"{where}: the private key is encrypted; give an unencrypted PEM key") from None
    except (ValueError, UnsupportedAlgorithm):
        raise KeyRefused(f"{where}: not a PEM private key") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name not in _CURVES:
        raise KeyRefused(f"{where}: model signing takes EC keys on P-256, P-384 or P-521 only")
    return key


def load_public_key(pem: bytes, where: str) -> ec.EllipticCurvePublicKey:
    """A PEM EC public key on a supported curve; KeyRefused naming ``where`` else."""
    try:
        key = serialization.load_pem_public_key(pem)
    except (ValueError, UnsupportedAlgorithm):
        raise KeyRefused(f"{where}: not a PEM public key") from None
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name not in _CURVES:
        raise KeyRefused(f"{where}: model signing takes EC keys on P-256, P-384 or P-521 only")
    return key


def key_hint(public: ec.EllipticCurvePublicKey) -> str:
    """The bundle's ``publicKey.hint``: sha256 of the public key's PEM (SubjectPublicKeyInfo), as model-signing."""
    pem = public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(pem).hexdigest()


def pae(payload: bytes) -> bytes:
    """DSSE v1 pre-authentication encoding of an in-toto payload: what the signature covers."""
    return b"DSSEv1 %d %s %d %s" % (len(PAYLOAD_TYPE), PAYLOAD_TYPE.encode(), len(payload), payload)


def statement(name: str, files: list[FileRecord], digest: str | None = None) -> dict:
    """The in-toto statement for ``files`` (model signing's ``files`` serialization, sha256). Pure."""
    ordered = sorted(files, key=lambda f: f.path)
    root = hashlib.sha256(b"".join(bytes.fromhex(f.sha256) for f in ordered)).hexdigest()
    predicate: dict = {
        "serialization": {"method": "files", "hash_type": "sha256", "allow_symlinks": False},
        "resources": [{"name": f.path, "algorithm": "sha256", "digest": f.sha256} for f in ordered],
    }
    if digest is not None:
        predicate["stoker"] = {"digest": digest}
    return {"_type": STATEMENT_TYPE, "subject": [{"name": name, "digest": {"sha256": root}}],
            "predicateType": PREDICATE_TYPE, "predicate": predicate}


def sign(files: list[FileRecord], key: ec.EllipticCurvePrivateKey, name: str, digest: str | None = None) -> bytes:
    """``model.sig``'s bytes: the bundle over the statement for ``files``."""
    payload = json.dumps(statement(name, files, digest), indent=2, sort_keys=True).encode()
    sig = key.sign(pae(payload), ec.ECDSA(_CURVES[key.curve.name]()))
    bundle = {
        "mediaType": BUNDLE_MEDIA_TYPE,
        "verificationMaterial": {"publicKey": {"hint": key_hint(key.public_key())}, "tlogEntries": []},
        "dsseEnvelope": {"payload": base64.b64encode(payload).decode(), "payloadType": PAYLOAD_TYPE,
                         "signatures": [{"sig": base64.b64encode(sig).decode(), "keyid": ""}]},
    }
    return json.dumps(bundle, indent=2).encode()


def verify(blob: bytes, key: ec.EllipticCurvePublicKey, where: str) -> Signed:
    """What the signature ``blob`` (a ``model.sig``) vouches for, once its signature checks out with ``key``.

    Raises:
        SignatureRefused: ``where: <why>`` — not a bundle, signed with another key, a bad signature, or a statement
            that is not model signing's (or whose resources do not hash to its subject).
    """
    try:
        bundle = json.loads(blob)
        envelope = bundle["dsseEnvelope"]
        payload = base64.b64decode(envelope["payload"], validate=True)
        sigs = [base64.b64decode(s["sig"], validate=True) for s in envelope["signatures"]]
        hint = ((bundle.get("verificationMaterial") or {}).get("publicKey") or {}).get("hint")
        payload_type = envelope["payloadType"]
    except (ValueError, KeyError, TypeError, AttributeError):
        raise SignatureRefused(f"{where}: not a model signing bundle (DSSE envelope)") from None
    if payload_type != PAYLOAD_TYPE:
        raise SignatureRefused(f"{where}: payload type {str(payload_type)[:60]!r}, not in-toto")
    if hint and hint != key_hint(key):
        raise SignatureRefused(f"{where}: signed with another key (public key sha256 {str(hint)[:12]}, "
                               f"expected {key_hint(key)[:12]})")
    if not any(_valid(key, s, payload) for s in sigs):
        raise SignatureRefused(f"{where}: the signature does not verify with the public key "
                               f"(sha256 {key_hint(key)[:12]}): the statement was altered or signed with another key")
    return _signed(payload, where)


def _valid(key: ec.EllipticCurvePublicKey, sig: bytes, payload: bytes) -> bool:
    try:
        key.verify(sig, pae(payload), ec.ECDSA(_CURVES[key.curve.name]()))
        return True
    except InvalidSignature:
        return False


def _signed(payload: bytes, where: str) -> Signed:
    try:
        st = json.loads(payload)
        if st["_type"] != STATEMENT_TYPE or st["predicateType"] != PREDICATE_TYPE:
            raise ValueError
        (subject,) = st["subject"]
        predicate = st["predicate"]
        if predicate["serialization"].get("method") != "files" or predicate["serialization"].get("hash_type") != "sha256":
            raise SignatureRefused(f"{where}: serialization {predicate['serialization'].get('method')!r}/"
                                   f"{predicate['serialization'].get('hash_type')!r}; stoker checks files/sha256 only")
        files = {r["name"]: r["digest"] for r in predicate["resources"] if r["algorithm"] == "sha256"}
        if len(files) != len(predicate["resources"]):
            raise SignatureRefused(f"{where}: a resource is not hashed with sha256")
        root = hashlib.sha256(b"".join(bytes.fromhex(files[n]) for n in sorted(files))).hexdigest()
        stoker = predicate.get("stoker") or {}
        name = str(subject.get("name", ""))
        expected_root = subject["digest"]["sha256"]
    except SignatureRefused:
        raise
    except (ValueError, KeyError, TypeError, AttributeError):
        raise SignatureRefused(f"{where}: the signed statement is not model signing's v1.0") from None
    if root != expected_root:
        raise SignatureRefused(f"{where}: the signed resources do not hash to the statement's subject")
    return Signed(files=files, digest=stoker.get("digest"), name=name)


def first_difference(signed: dict[str, str], actual: dict[str, str | None], where: str) -> str | None:
    """One line naming the first object (in path order) that differs from the signed build, or None. Pure.

    ``actual``: each object present, by path, with its sha256 (None: not read). A signed object missing, one whose
    sha256 differs, and one the signature does not list all count; the line also says how many others differ.
    """
    diffs = []
    for path in sorted(set(signed) | set(actual)):
        if path not in actual:
            diffs.append(f"{where}/{path} is missing (the signature lists it)")
        elif path not in signed:
            diffs.append(f"{where}/{path} is not in the signed build")
        elif actual[path] != signed[path]:
            diffs.append(f"{where}/{path} differs from the signed build (sha256 {str(actual[path])[:12]}, signed "
                         f"{signed[path][:12]})")
    if not diffs:
        return None
    more = f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else ""
    return diffs[0] + more
