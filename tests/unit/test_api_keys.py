"""API keys at the stable endpoint: the spec's section, the keys' file, the proxy's rendered checks. Pure.

The keys' behaviour on a running proxy (401s, rotation without a restart, gRPC) is tested on the real
HAProxy in tests/integration/test_endpoint_boundary.py.
"""

from __future__ import annotations

import hashlib
import subprocess

import pytest

from stoker.errors import SpecError
from stoker.serving import api_keys, haproxy
from stoker.containers.ports import Ports
from stoker.spec.load import parse_spec

BASE = {"model": {"repo_id": "org/model"}, "storage": {"bucket": "bkt"}}
KEY_A, KEY_B = "k-" + "a" * 30, "k-" + "b" * 30


def test_keys_file_gives_sorted_digests_and_bad_lines_are_named_by_number_never_by_content():
    keys = api_keys.parse(f"# rotation: B is new\n{KEY_B}\n\n  {KEY_A}  \n{KEY_A}\n", "file k.txt")
    assert keys.digests == tuple(sorted(hashlib.sha256(k.encode()).hexdigest() for k in (KEY_A, KEY_B)))
    assert len(keys) == 2 and keys.source == "file k.txt"
    assert api_keys.parse(f'["{KEY_A}"]', "block").digests == (api_keys.digest(KEY_A),)
    for text, says in ((f"{KEY_A}\nshort-secret\n", "entry 2 is not a key"),
                       (f"{KEY_A}\nhas a space in it, sixteen+\n", "entry 2 is not a key"),
                       ("# only a comment\n\n", "no key"),
                       ("[1, 2", "not a JSON list")):
        with pytest.raises(api_keys.ApiKeysError) as exc:
            api_keys.parse(text, "file k.txt")
        message = str(exc.value)
        assert says in message and "\n" not in message and "short-secret" not in message and "space" not in message
    with pytest.raises(api_keys.ApiKeysError, match="at most 100"):
        api_keys.parse("".join(f"key-number-{i:08d}\n" for i in range(101)), "f")


def test_the_file_the_proxy_reads_holds_digests_only(tmp_path):
    keys = api_keys.load(_spec_keys(tmp_path))
    api_keys.publish(tmp_path / "proxy", keys)
    text = (tmp_path / "proxy" / api_keys.DIGESTS_NAME).read_text()
    assert text.split() == list(keys.digests) and KEY_A not in text
    assert (tmp_path / "proxy" / api_keys.DIGESTS_NAME).stat().st_mode & 0o077 == 0
    api_keys.publish(tmp_path / "proxy", None)
    assert not (tmp_path / "proxy" / api_keys.DIGESTS_NAME).exists()
    with pytest.raises(api_keys.ApiKeysError, match="cannot read .*missing.txt"):
        api_keys.load(parse_spec({**BASE, "deploy": {"api_keys": {"file": str(tmp_path / "missing.txt")}}})
                      .deploy.api_keys)


def _spec_keys(tmp_path):
    (tmp_path / "keys.txt").write_text(f"{KEY_A}\n")
    return parse_spec({**BASE, "deploy": {"api_keys": {"file": str(tmp_path / "keys.txt")}}}).deploy.api_keys


def test_spec_opens_a_public_address_with_keys_and_refuses_malformed_keys(tmp_path):
    keyed = parse_spec({**BASE, "deploy": {"listen": "0.0.0.0", "api_keys": {"file": "/etc/stoker/keys"}}})
    assert keyed.deploy.api_keys.file.name == "keys"
    assert "api_keys" not in parse_spec(BASE).model_dump()["deploy"]  # off: manifests and digests as before
    for deploy, says in (({"api_keys": {}}, "give api_keys.file or api_keys.secret_block"),
                         ({"api_keys": {"file": "k", "secret_block": "b"}}, "give api_keys.file or"),
                         ({"api_keys": {"key": "inline-secret-value"}}, "api_keys.key: unknown key")):
        with pytest.raises(SpecError) as exc:
            parse_spec({**BASE, "deploy": deploy})
        assert says in str(exc.value) and "\n" not in str(exc.value)
    # Every target deploys behind the proxy that checks them (one serving path).
    gpu = parse_spec({**BASE, "target": "tensorrt", "gpus": {"type": "h100-80gb", "count": 1},
                      "deploy": {"api_keys": {"secret_block": "keys"}}})
    assert gpu.deploy.api_keys.secret_block == "keys"


def _layout(**kw) -> haproxy.ProxyLayout:
    return haproxy.ProxyLayout(listen=Ports(8000, 8001, 8002), slots={"blue": Ports(9000, 9001, 9002)}, live="blue",
                               **kw)


def test_rendered_proxy_asks_every_route_but_health_for_a_key_and_is_unchanged_without_keys():
    plain = haproxy.render(_layout())
    assert "authorization" not in plain and "ssl" not in plain
    keyed = haproxy.render(_layout(keys="/stoker/api-keys.sha256", openai="unix@/stoker/openai/api.sock"))
    frontends = {f.split("\n")[0]: f for f in keyed.split("frontend ")[1:]}
    for name, refusal in (("http", "status 401"), ("grpc", "grpc-status 16"), ("metrics", "status 401")):
        block = frontends[name]
        assert "sha2(256),hex,lower -f /stoker/api-keys.sha256" in block
        # The key check comes before the route check: an unauthenticated client learns nothing about routes.
        assert block.index(refusal) < block.index("acl public" if name != "metrics" else "only /metrics")
    assert "!health !bearer or !health !key_ok" in frontends["http"] and "/v2/health/ready" in frontends["http"]
    assert '"code\\": \\"invalid_api_key\\"' in frontends["http"]  # OpenAI's shape on /v1/
    tls = haproxy.render(_layout(tls="/stoker/tls.pem"))
    assert "bind 127.0.0.1:8001 proto h2 ssl crt /stoker/tls.pem alpn h2" in tls
    assert "bind 127.0.0.1:8000 ssl crt /stoker/tls.pem alpn http/1.1" in tls


def test_rotation_is_one_transaction_on_the_runtime_api():
    assert api_keys.parse_prepare("New version created: 3\n") == "3"
    cmds = api_keys.runtime_commands("/stoker/k", "3", ("aa", "bb"))
    assert cmds == "add acl @3 /stoker/k aa; add acl @3 /stoker/k bb; commit acl @3 /stoker/k"
    assert api_keys.parse_acl_entries("0x55d0 aa\n0x55d8 bb\n\n") == {"aa", "bb"}


def test_preflight_reads_keys_and_tls_files_in_one_line_before_any_heavy_step(tmp_path):
    from stoker.plan.preflight import check_endpoint
    from stoker.serving.deployment import TlsError

    (tmp_path / "keys.txt").write_text(f"{KEY_A}\n{KEY_B}\n")
    (tmp_path / "cert.pem").write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    (tmp_path / "key.pem").write_text("not a pem file")
    deploy = {"listen": "0.0.0.0", "openai": False, "api_keys": {"file": str(tmp_path / "keys.txt")},
              "tls": {"cert_file": str(tmp_path / "cert.pem"), "key_file": str(tmp_path / "key.pem")}}
    lines: list[str] = []
    with pytest.raises(TlsError, match=r"^deploy.tls: the key .*key.pem is not PEM$"):
        check_endpoint(parse_spec({**BASE, "deploy": deploy}), lines.append)
    (tmp_path / "key.pem").write_text("-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n")
    with pytest.raises(TlsError, match=r"^deploy.tls: .*cert.pem and .*key.pem do not load as a pair: "):
        check_endpoint(parse_spec({**BASE, "deploy": deploy}), lines.append)
    # Issue 49: a key that is PEM but not the certificate's took the endpoint down once HAProxy refused it.
    for name in ("a", "b"):
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-days", "1", "-subj", "/CN=localhost", "-keyout", str(tmp_path / f"{name}.key"),
                        "-out", str(tmp_path / f"{name}.crt")], check=True, capture_output=True)
    deploy["tls"] = {"cert_file": str(tmp_path / "a.crt"), "key_file": str(tmp_path / "b.key")}
    with pytest.raises(TlsError, match=r"do not load as a pair: the key does not match the certificate$"):
        check_endpoint(parse_spec({**BASE, "deploy": deploy}), lines.append)
    deploy["tls"]["key_file"] = str(tmp_path / "a.key")
    check_endpoint(parse_spec({**BASE, "deploy": deploy}), lines.append)
    assert lines == [f"preflight: the endpoint on 0.0.0.0 asks for 2 API key(s) from file {tmp_path / 'keys.txt'} "
                     f"and TLS with {tmp_path / 'a.crt'}"]
    assert KEY_A not in lines[0]


def test_status_says_what_a_proxy_asks_from_its_label():
    from stoker.serving.deployment import Target

    assert Target.asks("open") == "nothing (no API key)"
    assert Target.asks("openai-uds") == "nothing (no API key)"
    assert Target.asks("keys,openai-uds,tls:0123abcd") == "an API key and TLS"
