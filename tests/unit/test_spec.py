import pytest

from stoker.errors import SpecError
from stoker.spec.load import load_spec, parse_spec

BASE = {"model": {"repo_id": "org/model"}, "storage": {"bucket": "my-bucket"}}


def spec_with(**sections):
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in BASE.items()}
    for k, v in sections.items():
        data[k] = {**data.get(k, {}), **v} if isinstance(v, dict) else v
    return data


def test_defaults_fill_every_section():
    spec = parse_spec(BASE)
    assert spec.model.revision == "main"
    assert spec.quantization.format == "none"
    assert spec.target == "reference"
    assert spec.deploy.ports.http == 8000 and spec.deploy.ulimits == {}
    assert spec.benchmark.concurrency == [1, 4]


@pytest.mark.parametrize("sections, message", [
    ({"quantization": {"format": "fp4"}}, "quantization.format: Input should be 'none', 'fp8'"),
    ({"model": {"colour": "red"}}, "model.colour: unknown key"),
    ({"surprise": 1}, "surprise: unknown key"),
    ({"storage": {"bucket": "Bad_Bucket"}}, "storage.bucket: 'Bad_Bucket' is not a valid bucket name"),
    ({"quantization": {"kv_cache_dtype": "fp8"}}, "quantization: kv_cache_dtype needs a weight format"),
    ({"quantization": {"format": "fp8", "kv_cache_dtype": "int8"}}, "quantization: kv_cache_dtype 'int8' cannot be exported"),
    ({"deploy": {"ports": {"http": 9000, "grpc": 9000}}}, "deploy.ports: http, grpc and metrics ports must differ"),
    ({"model": {"local_path": "/tmp/x"}}, "model: set exactly one of model.repo_id or model.local_path"),
    ({"model": {"repo_id": "no-slash"}}, "model.repo_id: 'no-slash' is not an 'org/name' repo id"),
    ({"benchmark": {"concurrency": []}}, "benchmark.concurrency: give at least one concurrency level"),
    ({"benchmark": {"requests_per_level": 0}}, "benchmark.requests_per_level: Input should be greater than or equal to 1"),
    ({"deploy": {"name": "Has Spaces"}}, "deploy.name: 'Has Spaces': use lowercase"),
    ({"target": "onnx"}, "target: Input should be 'reference'"),
])
def test_bad_values_give_one_line_naming_the_field(sections, message):
    with pytest.raises(SpecError) as err:
        parse_spec(spec_with(**sections), "s.yaml")
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith("s.yaml: " + message), text


def test_missing_storage_is_required():
    with pytest.raises(SpecError, match=r"^x: storage: required$"):
        parse_spec({"model": {"repo_id": "a/b"}}, "x")


def test_load_spec_reports_yaml_and_file_problems(tmp_path):
    with pytest.raises(SpecError, match="no such file"):
        load_spec(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(bad)
    top = tmp_path / "list.yaml"
    top.write_text("- a\n- b\n")
    with pytest.raises(SpecError, match="expected a mapping"):
        load_spec(top)


def test_relative_paths_are_anchored_at_the_spec_file(tmp_path):
    (tmp_path / "ckpt").mkdir()
    f = tmp_path / "spec.yaml"
    f.write_text("model: {local_path: ckpt}\nquantization: {format: fp8, calibration: {text_file: cal.txt}}\n"
                 "storage: {bucket: b-1}\n")
    spec = load_spec(f)
    assert spec.model.local_path == tmp_path / "ckpt"
    assert spec.quantization.calibration.text_file == tmp_path / "cal.txt"


def test_digest_changes_with_any_value_and_not_with_key_order():
    a = parse_spec(spec_with(benchmark={"output_tokens": 32, "input_tokens": 16}))
    b = parse_spec(spec_with(benchmark={"input_tokens": 16, "output_tokens": 32}))
    c = parse_spec(spec_with(benchmark={"input_tokens": 17, "output_tokens": 32}))
    assert a.digest() == b.digest() != c.digest()


def test_shipped_specs_validate():
    from pathlib import Path

    from stoker.demo import DEMO_SPEC

    root = Path(__file__).resolve().parents[2]
    full = load_spec(root / "deployments" / "specs" / "example-full.yaml")
    assert full.quantization.format == "int4_awq" and full.deploy.ports.http == 8110
    import yaml

    demo = parse_spec(yaml.safe_load(DEMO_SPEC.read_text()), "demo")
    assert demo.quantization.format == "fp8" and demo.storage.create_bucket


def test_the_stable_endpoint_listens_on_loopback_unless_the_spec_says_otherwise_in_as_many_words():
    base = {"model": {"repo_id": "org/model"}, "storage": {"bucket": "bkt"}}
    assert parse_spec(base).deploy.listen == "127.0.0.1"
    assert "listen" not in parse_spec(base).model_dump()["deploy"]  # defaults stay out of manifests and digests
    with pytest.raises(SpecError) as exc:
        parse_spec({**base, "deploy": {"listen": "0.0.0.0"}})
    assert str(exc.value) == ("spec: deploy: listen 0.0.0.0 lets other machines reach the endpoint with no API key: "
                              "set deploy.api_keys, keep 127.0.0.1, or set deploy.allow_unauthenticated: true to "
                              "serve it open")
    with pytest.raises(SpecError, match="'eth0' is not an IP address"):
        parse_spec({**base, "deploy": {"listen": "eth0"}})
    assert parse_spec({**base, "deploy": {"listen": "::1"}}).deploy.listen == "::1"  # loopback: no key needed
    opened = parse_spec({**base, "deploy": {"listen": "0.0.0.0", "allow_unauthenticated": True}})
    assert opened.model_dump()["deploy"]["listen"] == "0.0.0.0"


def test_two_adapter_names_with_one_task_id_are_refused_at_load(monkeypatch):
    import stoker.spec.adapters as adapters

    two = {"adapters": [{"name": "alpha", "repo_id": "org/a"}, {"name": "beta", "repo_id": "org/b"}]}
    assert [a.name for a in parse_spec(spec_with(**two)).adapters] == ["alpha", "beta"]
    # A real collision of the 53-bit hash takes ~10^8 names to find; a coarser hash shows the check refuses one.
    monkeypatch.setattr(adapters, "task_id", lambda name: 7)
    with pytest.raises(SpecError) as err:
        parse_spec(spec_with(**two), "s.yaml")
    assert "\n" not in str(err.value)
    assert "'beta' and 'alpha' hash to one lora_task_id (7)" in str(err.value)
