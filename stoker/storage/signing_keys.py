"""The keys signed builds use (spec ``signing``), resolved when used: a Prefect Secret block or a PEM file named in
the environment, as the Hub token and the webhook secret are read.

Signing is on where a private key is configured (``signing.key_secret``, or ``$STOKER_SIGNING_KEY`` naming a PEM
file); verification is on where a public key is (``signing.public_key``, ``$STOKER_SIGNING_PUBLIC_KEY``, or the
signing key's own). Neither: builds are unsigned and unverified, and `stoker plan` says so. The private key stays in
memory: specs, manifests, artifacts and logs name the block or the variable, never the key.
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric import ec

from ..errors import SpecError
from ..spec.schema import Signing
from .signature import KeyRefused, load_private_key, load_public_key


def _secret_pem(name: str) -> bytes:
    from prefect.blocks.system import Secret

    try:
        value = Secret.load(name).get()
    except ValueError:
        raise SpecError(f"signing.key_secret: no Prefect Secret block named {name!r}") from None
    if not value:
        raise SpecError(f"signing.key_secret: Prefect Secret {name!r} is empty")
    return str(value).encode()


def read_key_file(path: str | Path, where: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise KeyRefused(f"{where}: cannot read {path} ({err.strerror or type(err).__name__})") from None


def private_key(signing: Signing) -> ec.EllipticCurvePrivateKey | None:
    """The signing key, or None where none is configured. SpecError / KeyRefused in one line (never the key)."""
    if signing.key_secret:
        return load_private_key(_secret_pem(signing.key_secret), f"signing.key_secret {signing.key_secret!r}")
    path = os.environ.get(signing.key_env)
    if path:
        return load_private_key(read_key_file(path, f"${signing.key_env}"), f"${signing.key_env} ({path})")
    return None


def public_key(signing: Signing) -> ec.EllipticCurvePublicKey | None:
    """The key builds are verified with, or None where neither a public nor a signing key is configured."""
    if signing.public_key is not None:
        return load_public_key(read_key_file(signing.public_key, "signing.public_key"), f"signing.public_key "
                               f"({signing.public_key})")
    path = os.environ.get(signing.public_key_env)
    if path:
        return load_public_key(read_key_file(path, f"${signing.public_key_env}"), f"${signing.public_key_env} ({path})")
    key = private_key(signing)
    return key.public_key() if key is not None else None


def describe(signing: Signing) -> str:
    """One line for `stoker plan`: whether builds are signed and verified, and with which key's source. No I/O
    beyond the environment: a block is named, not read."""
    if signing.key_secret:
        signs = f"builds signed (key: Prefect Secret block {signing.key_secret!r})"
    elif os.environ.get(signing.key_env):
        signs = f"builds signed (key: ${signing.key_env})"
    else:
        signs = f"builds unsigned: no signing key (signing.key_secret or ${signing.key_env})"
    if signing.public_key is not None:
        verifies = f"verified before a backend starts (signing.public_key {signing.public_key})"
    elif os.environ.get(signing.public_key_env):
        verifies = f"verified before a backend starts (${signing.public_key_env})"
    elif signing.key_secret or os.environ.get(signing.key_env):
        verifies = "verified before a backend starts (the signing key's public key)"
    else:
        verifies = "not verified: no public key"
    return f"{signs}; {verifies}"
