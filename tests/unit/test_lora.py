"""LoRA adapters on the reference runtime, against transformers + PEFT as the reference: greedy ids equal, alone and
with sequences for other adapters and for the base in one batch, for each architecture the reference path serves;
adapters that do not fit are refused in one line."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from test_batching import ARCHS, PROMPTS, _run
from test_runtime import CONFIGS, NO_END, PROMPT, hf_greedy, hf_model, write_artifact

from stoker.runtime.batch import Batcher
from stoker.runtime.generate import generate
from stoker.runtime.lora_config import LINEAR_MODULES, AdapterError, check_against_base, read_config
from stoker.runtime.model import load_model


def make_adapter(base, root: Path, seed: int, r: int = 4, rslora: bool = False, targets=None) -> Path:
    """A PEFT LoRA adapter for ``base`` with random A and B (PEFT's default B = 0 would change nothing)."""
    model_type = base.config.model_type
    config = peft.LoraConfig(r=r, lora_alpha=2 * r + seed, use_rslora=rslora, init_lora_weights=False,
                             target_modules=list(targets or LINEAR_MODULES[model_type]), lora_dropout=0.0)
    torch.manual_seed(100 + seed)
    peft_model = peft.get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():  # big enough to change the greedy ids
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.mul_(3.0)
    peft_model.save_pretrained(root)
    return root


def peft_model(base, adapter: Path):
    return peft.PeftModel.from_pretrained(copy.deepcopy(base), str(adapter)).eval()


@pytest.fixture(scope="module", params=sorted(ARCHS))
def served(request, tmp_path_factory):
    arch = request.param
    CONFIGS.setdefault(arch, ARCHS[arch])
    root = tmp_path_factory.mktemp(arch)
    base = hf_model(arch)
    adapters = {"a1": make_adapter(base, root / "a1", 1), "a2": make_adapter(base, root / "a2", 2, r=8, rslora=True,
                                                                             targets=LINEAR_MODULES[arch][:2])}
    model = load_model(write_artifact(base, root / "artifact"), num_threads=2, adapters=adapters)
    return base, {name: peft_model(base, folder) for name, folder in adapters.items()}, model


def test_each_adapter_alone_equals_peft_and_the_base_is_untouched(served):
    base, adapters, model = served
    want_base = hf_greedy(base, PROMPT, 16)
    assert list(generate(model, PROMPT, 16, NO_END)) == want_base
    for name, reference in adapters.items():
        want = hf_greedy(reference, PROMPT, 16)
        assert want != want_base  # the adapter really changes the answer
        assert list(generate(model, PROMPT, 16, NO_END, adapter=name)) == want, name


def test_adapters_and_the_base_in_one_batch_equal_each_alone(served):
    base, adapters, model = served
    names = [None, "a1", "a2", "a1", None]
    want = [hf_greedy(adapters[n] if n else base, p, 12) for n, p in zip(names, PROMPTS)]
    batcher = Batcher(model, max_batch=8)
    try:
        got = _run(batcher, [(p, 12, {"adapter": n}) for n, p in zip(names, PROMPTS)])
    finally:
        batcher.stop()
    assert got == want
    assert batcher.largest_step > 1 or not batcher.batched


def test_an_unknown_adapter_is_refused_before_compute_and_others_go_on(served):
    _base, _adapters, model = served
    with pytest.raises(ValueError, match=r"unknown adapter 'nope' \(served: a1, a2\)"):
        generate(model, PROMPT, 4, NO_END, adapter="nope")
    assert len(list(generate(model, PROMPT, 4, NO_END, adapter="a1"))) == 4


def test_adapters_that_do_not_fit_are_refused_in_one_line(tmp_path):
    base = hf_model("llama")
    good = make_adapter(base, tmp_path / "good", 1)
    cfg = read_config(good)
    base_cfg = base.config.to_dict()
    other = hf_model("llama", hidden_size=64, intermediate_size=128)
    wrong_base = make_adapter(other, tmp_path / "other", 1)
    artifact = write_artifact(base, tmp_path / "artifact")
    with pytest.raises(AdapterError) as err:
        load_model(artifact, adapters={"x": wrong_base})
    assert "an adapter made for another base" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(AdapterError, match="rank 4 is above lora.max_rank 2"):
        check_against_base(cfg, base_cfg, 2, "adapter good")
    with pytest.raises(AdapterError, match="target module.*lm_head.*not linear layers of a llama decoder"):
        check_against_base(read_config(make_adapter(base, tmp_path / "head", 1, targets=["q_proj", "lm_head"])),
                           base_cfg, 64, "adapter head")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    (pickled / "adapter_model.bin").write_bytes(b"not served")
    with pytest.raises(AdapterError, match="no adapter_model.safetensors .safetensors only"):
        load_model(artifact, adapters={"p": pickled})
    dora = json.loads((good / "adapter_config.json").read_text()) | {"use_dora": True}
    (pickled / "adapter_config.json").write_text(json.dumps(dora))
    with pytest.raises(AdapterError, match="use_dora .DoRA. is not served"):
        read_config(pickled)


def test_a_new_adapter_commit_is_a_new_watch_key_and_the_started_spec_pins_every_commit():
    from flows.watch_revisions import Watch, dedup_key

    from stoker.spec.load import parse_spec

    spec = parse_spec({"model": {"repo_id": "org/base"}, "storage": {"bucket": "bkt"},
                       "adapters": [{"name": "support", "repo_id": "org/support-lora"}]})
    w = Watch(spec=spec)
    base = "a" * 40
    assert dedup_key(w, base) != dedup_key(w, base, {"support": "b" * 40})
    assert dedup_key(w, base, {"support": "b" * 40}) != dedup_key(w, base, {"support": "c" * 40})
    assert dedup_key(w, base, {"support": "b" * 40}) == dedup_key(w, base, {"support": "b" * 40})


def test_within_one_plan_each_revision_is_resolved_once_and_keeps_its_sha(monkeypatch):
    """The plan's rows must name one commit per revision, the base's and each adapter's, even if a branch moves
    between them; each is asked of the Hub once. Outside a plan every call asks afresh."""
    from stoker import adapters as lora
    from stoker.spec.load import parse_spec
    from stoker.storage import hub
    from stoker.storage.source import resolve_source

    spec = parse_spec({"model": {"repo_id": "org/base"}, "storage": {"bucket": "bkt"},
                       "adapters": [{"name": "support", "repo_id": "org/support-lora"}]})
    heads = iter("bcdefg")
    asked = []
    monkeypatch.setattr(hub, "_resolve", lambda repo, rev, *a: asked.append(repo) or next(heads) * 40)
    with hub.resolving_once():
        first, base = lora.resolve(spec), resolve_source(spec)[0]
        first["support"] = "mutated by a caller"
        again, base_again = lora.resolve(spec), resolve_source(spec)[0]
    assert again == {"support": "b" * 40} and base == base_again == "c" * 40
    assert asked == ["org/support-lora", "org/base"]
    assert lora.resolve(spec) == {"support": "d" * 40}  # outside: asked afresh each time, as a watcher must
    assert lora.resolve(spec) == {"support": "e" * 40}


def test_the_plan_asks_the_hub_for_adapter_shas_only_once_the_weights_are_cached(tmp_path, monkeypatch):
    from stoker import adapters as lora
    from stoker.cache.keys import adapters_key, package_key
    from stoker.plan.rows import package_row
    from stoker.run import RunContext
    from stoker.spec.load import parse_spec

    spec = parse_spec({"model": {"repo_id": "org/base"}, "storage": {"bucket": "bkt"},
                       "adapters": [{"name": "support", "repo_id": "org/support-lora"}]})
    ctx = RunContext.new(tmp_path)
    asked = []
    monkeypatch.setattr(lora, "resolve", lambda s: asked.append(s) or {"support": "b" * 40})
    row, digest = package_row(spec, ctx, package_key, "d" * 64, None)
    assert (row.status, digest, asked) == ("pending", None, [])  # nothing fetched yet: no Hub read
    row, digest = package_row(spec, ctx, package_key, "d" * 64, "w" * 64)
    assert (row.status, digest, len(asked)) == ("pending", None, 1)  # asked, but the adapters step is not cached
    key = adapters_key(spec, {"support": "b" * 40}, "w" * 64)
    entry = ctx.store.publish("adapters", key, lambda out: (out / "adapters.json").write_text("{}") and {})
    row, _ = package_row(spec, ctx, package_key, "d" * 64, "w" * 64)
    assert row.status == "miss" and row.key == package_key(spec, "d" * 64, entry.digest)


def test_every_tensor_of_an_adapter_is_checked_and_a_crafted_header_is_refused_in_one_line(tmp_path):
    from safetensors.torch import load_file, save_file

    from stoker.adapters import tensor_shapes
    from stoker.runtime.lora_config import check_shapes

    base = hf_model("llama")
    base_cfg = base.config.to_dict()
    good = make_adapter(base, tmp_path / "good", 1, targets=["q_proj"])
    cfg = read_config(good)
    weights = good / "adapter_model.safetensors"
    assert check_shapes(tensor_shapes(weights), cfg, base_cfg, "a") == base_cfg["num_hidden_layers"]
    artifact = write_artifact(base, tmp_path / "artifact")

    def variant(name: str, extra: dict) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
        save_file({**load_file(str(weights)), **extra}, str(folder / "adapter_model.safetensors"))
        return folder

    h, vocab, r = base_cfg["hidden_size"], base_cfg["vocab_size"], cfg.r
    refused = {  # a module the config does not name; one it names but cannot be served; one outside the layers
        "head": ({"base_model.model.lm_head.lora_A.weight": torch.zeros(r, h),
                  "base_model.model.lm_head.lora_B.weight": torch.zeros(vocab, r)}, "lm_head, a module"),
        "kproj": ({"base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight": torch.zeros(r, h),
                   "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight": torch.zeros(h, r)},
                  "k_proj, a module adapter_config.json does not target"),
    }
    for name, (extra, message) in refused.items():
        folder = variant(name, extra)
        with pytest.raises(AdapterError, match=message):
            check_shapes(tensor_shapes(folder / "adapter_model.safetensors"), cfg, base_cfg, name)
        with pytest.raises(AdapterError, match=message) as err:  # the runtime applies the same rule
            load_model(artifact, adapters={name: folder})
        assert "\n" not in str(err.value)

    crafted = tmp_path / "crafted.safetensors"
    crafted.write_bytes((2**63).to_bytes(8, "little") + b"{}")  # a header size no file holds
    with pytest.raises(AdapterError, match=r"claims a 9223372036854775808-byte header in a 10-byte file"):
        tensor_shapes(crafted)
    crafted.write_bytes((4).to_bytes(8, "little") + b"[1,2")
    with pytest.raises(AdapterError, match="header is not a safetensors table"):
        tensor_shapes(crafted)
    crafted.write_bytes(b"abc")
    with pytest.raises(AdapterError, match="too short"):
        tensor_shapes(crafted)
