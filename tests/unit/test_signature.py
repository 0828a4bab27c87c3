"""Signed builds (issue 51): OpenSSF model signing's format, made and checked by stoker.storage.signature; the keys
(stoker.storage.signing_keys), the spec fields, and what `stoker plan` says."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from stoker.plan.compose import model_signature_note, signing_note
from stoker.spec.schema import Signing, Spec
from stoker.storage import signature, signing_keys
from stoker.storage.digest import FileRecord, tree_records
from stoker.storage.signature import KeyRefused, SignatureRefused

FIXTURE = Path(__file__).parent / "model_signing_1_1_1"
FILES = [FileRecord("tensorrt_llm/1/model.py", "a" * 64, 10), FileRecord("ensemble/config.pbtxt", "b" * 64, 3)]
DIGEST = "d" * 64


def _pem(key: ec.EllipticCurvePrivateKey, path: Path, password: bytes | None = None) -> Path:
    enc = serialization.BestAvailableEncryption(password) if password else serialization.NoEncryption()
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, enc))
    return path


def _pub_pem(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                    serialization.PublicFormat.SubjectPublicKeyInfo))
    return path


def test_sign_then_verify_gives_the_files_and_the_digest():
    key = ec.generate_private_key(ec.SECP256R1())
    blob = signature.sign(FILES, key, "stoker-build", DIGEST)
    signed = signature.verify(blob, key.public_key(), "s3://b/model.sig")
    assert signed.files == {"ensemble/config.pbtxt": "b" * 64, "tensorrt_llm/1/model.py": "a" * 64}
    assert signed.digest == DIGEST and signed.name == "stoker-build"
    bundle = json.loads(blob)
    assert bundle["mediaType"] == "application/vnd.dev.sigstore.bundle.v0.3+json"
    assert bundle["verificationMaterial"] == {"publicKey": {"hint": signature.key_hint(key.public_key())},
                                              "tlogEntries": []}
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    assert statement["predicateType"] == "https://model_signing/signature/v1.0"
    assert [r["name"] for r in statement["predicate"]["resources"]] == ["ensemble/config.pbtxt",
                                                                         "tensorrt_llm/1/model.py"]


@pytest.mark.parametrize("curve", [ec.SECP384R1(), ec.SECP521R1()])
def test_the_other_curves_model_signing_takes(curve):
    key = ec.generate_private_key(curve)
    assert signature.verify(signature.sign(FILES, key, "m"), key.public_key(), "x").digest is None


def test_a_signature_model_signing_made_verifies():
    key = signature.load_public_key((FIXTURE / "publisher.pub.pem").read_bytes(), "fixture")
    signed = signature.verify((FIXTURE / "model" / "model.sig").read_bytes(), key, "model.sig")
    actual = {r.path: r.sha256 for r in tree_records(FIXTURE / "model") if r.path != "model.sig"}
    assert signed.files == actual and signed.name == "model" and signed.digest is None


def test_another_key_is_refused_in_one_line():
    blob = signature.sign(FILES, ec.generate_private_key(ec.SECP256R1()), "m", DIGEST)
    other = ec.generate_private_key(ec.SECP256R1()).public_key()
    with pytest.raises(SignatureRefused, match=r"^s3://b/model.sig: signed with another key \(public key sha256 "):
        signature.verify(blob, other, "s3://b/model.sig")
    # Without the hint (as older model-signing bundles), the signature itself fails.
    bundle = json.loads(blob)
    del bundle["verificationMaterial"]["publicKey"]
    with pytest.raises(SignatureRefused, match="the signature does not verify with the public key"):
        signature.verify(json.dumps(bundle).encode(), other, "s3://b/model.sig")


def test_a_rewritten_statement_is_refused():
    key = ec.generate_private_key(ec.SECP256R1())
    bundle = json.loads(signature.sign(FILES, key, "m", DIGEST))
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    statement["predicate"]["resources"][0]["digest"] = "c" * 64  # an attacker's file, signature kept
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
    with pytest.raises(SignatureRefused, match="does not verify with the public key"):
        signature.verify(json.dumps(bundle).encode(), key.public_key(), "model.sig")


@pytest.mark.parametrize("blob", [b"", b"{}", b"not json", b'{"dsseEnvelope": {"payload": "!!"}}'])
def test_not_a_bundle(blob):
    key = ec.generate_private_key(ec.SECP256R1()).public_key()
    with pytest.raises(SignatureRefused, match=r"^model.sig: not a model signing bundle \(DSSE envelope\)$"):
        signature.verify(blob, key, "model.sig")


def test_first_difference_names_the_object():
    signed = {"a/config.pbtxt": "1" * 64, "b/1/model.py": "2" * 64}
    where = "s3://bk/p/repos/x/model_repository"
    assert signature.first_difference(signed, dict(signed), where) is None
    assert signature.first_difference(signed, {**signed, "b/1/model.py": "3" * 64}, where) == (
        f"{where}/b/1/model.py differs from the signed build (sha256 333333333333, signed 222222222222)")
    assert signature.first_difference(signed, {"a/config.pbtxt": "1" * 64}, where) == (
        f"{where}/b/1/model.py is missing (the signature lists it)")
    assert signature.first_difference(signed, {**signed, "b/1/evil.py": "4" * 64}, where) == (
        f"{where}/b/1/evil.py is not in the signed build")
    assert signature.first_difference(signed, {"a/config.pbtxt": "0" * 64, "c": "5" * 64}, where).endswith(
        "(and 2 more)")


def test_keys_refused_in_one_line(tmp_path: Path):
    with pytest.raises(KeyRefused, match=r"^\$K \(x\): the private key is encrypted"):
        signature.load_private_key(_pem(ec.generate_private_key(ec.SECP256R1()), tmp_path / "e.pem", b"pw")
                                   .read_bytes(), "$K (x)")
    ed = ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    with pytest.raises(KeyRefused, match="EC keys on P-256, P-384 or P-521 only"):
        signature.load_private_key(ed, "k")
    with pytest.raises(KeyRefused, match="^k: not a PEM public key$"):
        signature.load_public_key(b"-----BEGIN NOTHING-----", "k")


def test_keys_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("STOKER_SIGNING_KEY", raising=False)
    monkeypatch.delenv("STOKER_SIGNING_PUBLIC_KEY", raising=False)
    assert signing_keys.private_key(Signing()) is None and signing_keys.public_key(Signing()) is None
    key = ec.generate_private_key(ec.SECP256R1())
    monkeypatch.setenv("STOKER_SIGNING_KEY", str(_pem(key, tmp_path / "k.pem")))
    assert signing_keys.private_key(Signing()).private_numbers() == key.private_numbers()
    assert signing_keys.public_key(Signing()).public_numbers() == key.public_key().public_numbers()
    other = ec.generate_private_key(ec.SECP256R1())
    assert signing_keys.public_key(Signing(public_key=_pub_pem(other, tmp_path / "o.pub"))).public_numbers() == \
        other.public_key().public_numbers()
    monkeypatch.setenv("STOKER_SIGNING_KEY", str(tmp_path / "gone.pem"))
    with pytest.raises(KeyRefused, match=r"^\$STOKER_SIGNING_KEY: cannot read .*gone.pem"):
        signing_keys.private_key(Signing())


def test_plan_says_whether_builds_are_signed(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("STOKER_SIGNING_KEY", raising=False)
    monkeypatch.delenv("STOKER_SIGNING_PUBLIC_KEY", raising=False)
    spec = Spec.model_validate({"model": {"repo_id": "o/m"}, "storage": {"bucket": "bkt"}})
    assert signing_note(spec) == ("builds unsigned: no signing key (signing.key_secret or $STOKER_SIGNING_KEY); "
                                  "not verified: no public key")
    assert model_signature_note(spec) == ""
    monkeypatch.setenv("STOKER_SIGNING_KEY", "/keys/k.pem")
    assert signing_note(spec) == ("builds signed (key: $STOKER_SIGNING_KEY); verified before a backend starts (the "
                                  "signing key's public key)")
    blocked = spec.model_copy(update={"signing": Signing(key_secret="stoker-signing")})
    assert signing_note(blocked).startswith("builds signed (key: Prefect Secret block 'stoker-signing')")
    required = Spec.model_validate({"model": {"repo_id": "o/m", "public_key": "/k/p.pem", "require_signature": True},
                                    "storage": {"bucket": "bkt"}})
    assert model_signature_note(required) == "model.sig required, verified with /k/p.pem before the weights download"


def test_spec_fields_stay_out_of_dumps_until_set():
    spec = Spec.model_validate({"model": {"repo_id": "o/m"}, "storage": {"bucket": "bkt"}})
    dumped = spec.model_dump(mode="json")
    assert "signing" not in dumped and "require_signature" not in dumped["model"]
    assert "public_key" not in dumped["model"]
    with pytest.raises(ValueError, match="model.require_signature needs model.public_key"):
        Spec.model_validate({"model": {"repo_id": "o/m", "require_signature": True}, "storage": {"bucket": "bkt"}})
    signed = Spec.model_validate({"model": {"repo_id": "o/m"}, "storage": {"bucket": "bkt"},
                                  "signing": {"key_secret": "blk"}})
    assert signed.model_dump(mode="json")["signing"]["key_secret"] == "blk" and signed.digest() != spec.digest()

