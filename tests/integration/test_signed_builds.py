"""Signed builds against the session's real S3 (moto) and Hub mirror (olah): a signed build verifies; a bucket
rewritten by a writer without the key (object and digest record both) is refused naming the object, before anything
that serves is touched; a Hub model's model.sig is checked by the fetch, and required where the spec says so."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from stoker.deploy import rollout
from stoker.serving import signed_build
from stoker.spec.schema import Spec
from stoker.stack.hub_mirror import publish_model
from stoker.storage import hub, model_signature, s3, signature
from stoker.storage.digest import records_digest, tree_records
from stoker.storage.signature import SignatureRefused

pytestmark = [pytest.mark.s3, pytest.mark.hub]


def _key_file(path: Path) -> tuple[ec.EllipticCurvePrivateKey, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return key, path


def _public_file(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                    serialization.PublicFormat.SubjectPublicKeyInfo))
    return path


@pytest.fixture
def aws(local_stack, monkeypatch: pytest.MonkeyPatch) -> dict:
    for k, v in local_stack["aws_env"].items():
        monkeypatch.setenv(k, v)
    return local_stack


def _repository(root: Path) -> Path:
    for rel, text in {"ensemble/config.pbtxt": 'name: "ensemble"\n', "tensorrt_llm/config.pbtxt": 'name: "m"\n',
                      "tensorrt_llm/1/model.py": "def serve():\n    return 'the signed build'\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_signed_build_verifies_and_a_rewritten_bucket_is_refused(aws, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch):
    key, key_path = _key_file(tmp_path / "signing.pem")
    monkeypatch.setenv("STOKER_SIGNING_KEY", str(key_path))
    bucket = f"sign-{uuid.uuid4().hex[:12]}"
    # An unreachable Docker host: a refusal must come before stage touches anything that serves.
    spec = Spec.model_validate({"model": {"repo_id": "o/m"}, "deploy": {"docker_host": "tcp://127.0.0.1:9"},
                                "storage": {"bucket": bucket, "endpoint_url": aws["s3"], "create_bucket": True}})
    st = spec.storage
    local = _repository(tmp_path / "repo")
    records = tree_records(local)
    digest = records_digest(records)
    client = s3.client(st)
    s3.ensure_bucket(client, st, create=True)
    sig = signature.sign(records, key, f"stoker-{digest[:24]}", digest)  # what tasks/s3.py's upload signs
    s3.upload_tree(client, st, local, records, [], digest, lambda _m: None, signature=sig)
    base = f"{s3.repo_prefix(st, digest)}/model_repository"
    uri = s3.triton_uri(st, base)
    lines: list[str] = []

    assert signed_build.check(spec, uri, digest, lines.append) is True
    assert lines[-1].startswith(f"signature: build {digest[:12]} verified (3 objects at s3://{bucket}/{base} match ")
    # A repository mounted from this host (GPU targets) is checked file by file against the same signature.
    assert signed_build.check(spec, str(local), digest, lines.append) is True

    # A writer with bucket access but no key: new bytes, and the marker's sha256 and the object's metadata to match.
    evil = b"def serve():\n    return 'not the signed build'\n"
    evil_sha = __import__("hashlib").sha256(evil).hexdigest()
    target = f"{base}/tensorrt_llm/1/model.py"
    client.put_object(Bucket=bucket, Key=target, Body=evil, Metadata={"sha256": evil_sha})
    marker_key = f"{s3.repo_prefix(st, digest)}/{s3.MARKER}"
    marker = json.loads(client.get_object(Bucket=bucket, Key=marker_key)["Body"].read())
    for o in marker["objects"]:
        if o["key"] == target:
            o.update(sha256=evil_sha, bytes=len(evil))
    client.put_object(Bucket=bucket, Key=marker_key, Body=json.dumps(marker).encode())
    assert s3.read_marker(client, st, digest) is not None  # the digest record alone would take it

    with pytest.raises(SignatureRefused) as refused:
        rollout.stage(spec, uri, digest, "run-1", lines.append)
    assert str(refused.value) == (f"refused: s3://{bucket}/{target} differs from the signed build (sha256 "
                                  f"{evil_sha[:12]}, signed {dict((r.path, r.sha256) for r in records)['tensorrt_llm/1/model.py'][:12]})")

    # Its own signature over its files: made with another key, refused as such.
    client.put_object(Bucket=bucket, Key=s3.signature_key(st, digest),
                      Body=signature.sign(records, ec.generate_private_key(ec.SECP256R1()), "x", digest))
    with pytest.raises(SignatureRefused, match=r"model.sig: signed with another key"):
        signed_build.check(spec, uri, digest, lines.append)
    # No signature at all, while a key is configured.
    client.delete_object(Bucket=bucket, Key=s3.signature_key(st, digest))
    with pytest.raises(SignatureRefused, match=rf"model.sig: build {digest[:12]} is not signed, and a signing key "
                                               "is configured$"):
        signed_build.check(spec, uri, digest, lines.append)
    # With no key configured, verification is off (and says so), as before issue 51.
    monkeypatch.delenv("STOKER_SIGNING_KEY")
    assert signed_build.check(spec, uri, digest, lines.append) is False
    assert lines[-1].startswith(f"signature: build {digest[:12]} not verified (no public key")


def _model(root: Path, weights: bytes) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "llama"}\n')
    (root / "model.safetensors").write_bytes(weights)
    return root


def test_hub_model_signature_checked_and_required(aws, tmp_path: Path):
    publisher, _ = _key_file(tmp_path / "publisher.pem")
    pub = _public_file(publisher, tmp_path / "publisher.pub.pem")
    repos, endpoint = aws["repos"], aws["hub"]
    tag = uuid.uuid4().hex[:8]

    def publish(name: str, sig_key: ec.EllipticCurvePrivateKey | None, tamper: bool = False) -> tuple[str, str]:
        src = _model(tmp_path / name, b"weights " + name.encode())
        if sig_key is not None:
            (src / "model.sig").write_bytes(signature.sign(tree_records(src), sig_key, name))
        if tamper:  # published after signing: the signature no longer covers these bytes
            (src / "model.safetensors").write_bytes(b"other weights")
        repo_id = f"signed-{tag}/{name}"
        return repo_id, publish_model(repos, repo_id, src, name)

    def spec_for(repo_id: str, required: bool = True) -> Spec:
        return Spec.model_validate({"model": {"repo_id": repo_id, "endpoint": endpoint, "public_key": str(pub),
                                              "require_signature": required}, "storage": {"bucket": "unused"}})

    lines: list[str] = []
    repo_id, sha = publish("good", publisher)
    signed = model_signature.check_signature(spec_for(repo_id), sha, lines.append)
    dest = tmp_path / "fetched"
    records = hub.fetch(repo_id, sha, endpoint, None, dest)
    model_signature.check_files(signed, {r.path: r.sha256 for r in records}, repo_id)  # passes: the signed files
    assert lines == [f"signature: {repo_id}@{sha[:12]}/model.sig verified with model.public_key (2 files signed)"]

    repo_id, sha = publish("unsigned", None)
    with pytest.raises(SignatureRefused, match=rf"^model.require_signature: {repo_id}@{sha[:12]}/model.sig does not "
                                               r"exist \(the model is unsigned\)$"):
        model_signature.check_signature(spec_for(repo_id), sha, lines.append)
    assert model_signature.check_signature(spec_for(repo_id, required=False), sha, lines.append) is None
    assert lines[-1].endswith("the model is unsigned (model.require_signature is off)")

    repo_id, sha = publish("forged", ec.generate_private_key(ec.SECP256R1()))
    with pytest.raises(SignatureRefused, match=rf"^{repo_id}@{sha[:12]}/model.sig: signed with another key"):
        model_signature.check_signature(spec_for(repo_id, required=False), sha, lines.append)

    repo_id, sha = publish("tampered", publisher, tamper=True)
    signed = model_signature.check_signature(spec_for(repo_id), sha, lines.append)
    records = hub.fetch(repo_id, sha, endpoint, None, tmp_path / "tampered-fetch")
    with pytest.raises(SignatureRefused, match=rf"^refused: {repo_id}@{sha[:12]}/model.safetensors differs from the "
                                               r"model's signature"):
        model_signature.check_files(signed, {r.path: r.sha256 for r in records}, f"{repo_id}@{sha[:12]}")
