import json
import os

import pytest

from stoker.storage.digest import FileRecord, records_digest, tree_records
from stoker.cache.keys import build_key, package_key, quantize_key, step_key
from stoker.spec.load import parse_spec
from stoker.storage.store import StepStore

BASE = {"model": {"repo_id": "org/model"}, "storage": {"bucket": "my-bucket"}}


def test_step_key_is_stable_and_sensitive_to_every_part():
    k = step_key("s", inputs={"a": "1"}, config={"x": 1}, versions={"t": "1.0"})
    assert k == step_key("s", inputs={"a": "1"}, config={"x": 1}, versions={"t": "1.0"})
    assert len(k) == 24
    variants = [
        step_key("other", inputs={"a": "1"}, config={"x": 1}, versions={"t": "1.0"}),
        step_key("s", inputs={"a": "2"}, config={"x": 1}, versions={"t": "1.0"}),
        step_key("s", inputs={"a": "1"}, config={"x": 2}, versions={"t": "1.0"}),
        step_key("s", inputs={"a": "1"}, config={"x": 1}, versions={"t": "1.1"}),
    ]
    assert len({k, *variants}) == 5


def test_pipeline_keys_follow_their_inputs_and_sections(tmp_path):
    spec = parse_spec({**BASE, "quantization": {"format": "fp8"}})
    other_quant = parse_spec({**BASE, "quantization": {"format": "int4_awq"}})
    other_triton = parse_spec({**BASE, "quantization": {"format": "fp8"}, "triton": {"max_batch_size": 4}})
    assert quantize_key(spec, "w1") != quantize_key(spec, "w2")
    assert quantize_key(spec, "w1") != quantize_key(other_quant, "w1")
    # A section a step does not read must not change its key (no needless rebuilds).
    assert quantize_key(spec, "w1") == quantize_key(other_triton, "w1")
    assert build_key(spec, "c1") == build_key(other_triton, "c1")
    assert package_key(spec, "b1") != package_key(other_triton, "b1")


def test_calibration_text_content_is_part_of_the_quantize_key(tmp_path):
    cal = tmp_path / "cal.txt"
    cal.write_text("one")
    spec = parse_spec({**BASE, "quantization": {"format": "fp8", "calibration": {"text_file": str(cal)}}})
    before = quantize_key(spec, "w")
    cal.write_text("two")
    assert quantize_key(spec, "w") != before


def test_records_digest_covers_paths_and_bytes():
    a = [FileRecord("a.txt", "00", 1), FileRecord("b.txt", "11", 2)]
    assert records_digest(a) == records_digest(list(reversed(a)))
    assert records_digest(a) != records_digest([FileRecord("c.txt", "00", 1), a[1]])
    assert records_digest(a) != records_digest([FileRecord("a.txt", "01", 1), a[1]])


def test_store_publishes_atomically_and_finds_it_again(tmp_path):
    store = StepStore(tmp_path)
    assert store.lookup("build", "k1") is None

    def produce(out):
        (out / "w.bin").write_bytes(b"weights")
        (out / "sub").mkdir()
        (out / "sub" / "c.json").write_text("{}")
        return {"note": "made"}

    entry = store.publish("build", "k1", produce)
    again = StepStore(tmp_path).lookup("build", "k1")  # a new process sees the same entry
    assert again is not None and again.digest == entry.digest
    assert [f.path for f in again.files] == ["sub/c.json", "w.bin"]
    assert again.detail == {"note": "made"}
    assert (again.output_dir / "w.bin").read_bytes() == b"weights"
    assert again.digest == records_digest(tree_records(again.output_dir))


def test_a_failing_step_leaves_nothing_visible(tmp_path):
    store = StepStore(tmp_path)

    def boom(out):
        (out / "half.bin").write_bytes(b"partial")
        raise RuntimeError("crashed halfway")

    with pytest.raises(RuntimeError):
        store.publish("quantize", "k2", boom)
    assert store.lookup("quantize", "k2") is None
    assert os.listdir(tmp_path / "quantize") == []


def test_record_is_json_with_the_file_list(tmp_path):
    entry = StepStore(tmp_path).publish("fetch", "k3", lambda out: (out / "x").write_text("1") and {})
    record = json.loads((entry.path / "record.json").read_text())
    assert record["files"] == [{"path": "x", "sha256": "6b86b273ff34fce19d6b804eff5a3f5747ada4eaa22f1d49c01e52ddb7875b4b", "bytes": 1}]
