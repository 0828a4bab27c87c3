"""The engine repository's guided decoding: the `tensorrt_llm` parameters TensorRT-LLM's C++ backend needs to enforce
a guide, and the xgrammar tokenizer info file the package step writes for it (stoker/gpu/tokenizer_info.py), from a
real tiny tokenizer.json. Rendered by contract, not run here (no GPU, no TensorRT-LLM)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from google.protobuf import text_format
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tritonclient.grpc import model_config_pb2 as mc

from stoker.errors import StepError
from stoker.gpu import repository, tokenizer_info
from stoker.gpu.facts import known
from stoker.spec.load import parse_spec

LLAMA = known("meta-llama/Meta-Llama-3-8B-Instruct")
CORPUS = ['{"name": "abc", "ok": true}', "the quick brown fox jumps over the lazy dog", "[1, 2, 3] null"]


def _tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]))
    return tok


def _spec():
    return parse_spec({"model": {"repo_id": "meta-llama/Meta-Llama-3-8B-Instruct"}, "storage": {"bucket": "bkt"},
                       "target": "tensorrt", "gpus": {"type": "h100-80gb", "count": 1},
                       "deploy": {"image": "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"}})


@pytest.fixture
def packaged(tmp_path):
    """(repo, tokenizer, facts): the engine repository written from a folder holding the tiny tokenizer.json; the
    facts' end id is its <|eot_id|> and <|end_of_text|> its other eos, as Llama 3 Instruct's."""
    tok = _tokenizer()
    src = tmp_path / "hf"
    src.mkdir()
    tok.save(str(src / "tokenizer.json"))
    facts = dataclasses.replace(LLAMA, end_id=tok.token_to_id("<|eot_id|>"),
                                stop_ids=(tok.token_to_id("<|end_of_text|>"),), pad_id=tok.token_to_id("<|eot_id|>"))
    info = repository.write_repository(_spec(), facts, tmp_path / "repo", tokenizer_src=src)
    return tmp_path / "repo", tok, facts, info


def _params(repo) -> dict[str, str]:
    cfg = text_format.Parse((repo / "tensorrt_llm" / "config.pbtxt").read_text(), mc.ModelConfig())
    return {k: v.string_value for k, v in cfg.parameters.items()}


def test_the_engine_config_names_xgrammar_and_a_file_the_repository_holds(packaged) -> None:
    repo, _, _, info = packaged
    params = _params(repo)
    assert params["guided_decoding_backend"] == "xgrammar"
    path = params["xgrammar_tokenizer_info_path"]
    # The serve step mounts the repository at /models, where gpt_model_path points too.
    assert path == "/models/tensorrt_llm/1/xgrammar_tokenizer_info.json"
    assert params["gpt_model_path"].startswith("/models/tensorrt_llm/1/")
    assert (repo / path.removeprefix("/models/")).is_file()
    assert "tensorrt_llm/1/xgrammar_tokenizer_info.json" not in info["pending"]


def test_the_file_is_the_vocabulary_in_id_order_and_the_builds_end_id(packaged) -> None:
    repo, tok, facts, _ = packaged
    text = (repo / "tensorrt_llm/1/xgrammar_tokenizer_info.json").read_text()
    doc = json.loads(text)
    assert sorted(doc) == ["encoded_vocab", "stop_token_ids", "tokenizer_str"]
    size = tok.get_vocab_size(with_added_tokens=True)
    assert doc["encoded_vocab"] == [tok.id_to_token(i) for i in range(size)]
    assert doc["encoded_vocab"][facts.end_id] == "<|eot_id|>"
    assert doc["stop_token_ids"] == [facts.end_id]
    assert json.loads(doc["tokenizer_str"]) == json.loads(tok.to_str())
    # Pure: the same tokenizer and end id give the same bytes (the package is keyed by content).
    assert tokenizer_info.render(tok.to_str(), facts.end_id) == text


def test_the_file_matches_what_upstreams_generator_reads_from_transformers(packaged) -> None:
    """TensorRT-LLM's _xgrammar_tokenizer_info: get_vocab() sorted by id, backend_tokenizer.to_str(); the two agree
    on the vocabulary and on what xgrammar detects from tokenizer_str (stop id aside: stoker's is the end id)."""
    transformers = pytest.importorskip("transformers")
    xgrammar = pytest.importorskip("xgrammar")
    repo, _, _, _ = packaged
    doc = json.loads((repo / "tensorrt_llm/1/xgrammar_tokenizer_info.json").read_text())
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(repo / "preprocessing/1/tokenizer/tokenizer.json"))
    assert doc["encoded_vocab"] == [t for t, _ in sorted(hf.get_vocab().items(), key=lambda kv: kv[1])]
    detect = xgrammar.TokenizerInfo._detect_metadata_from_hf
    assert detect(doc["tokenizer_str"]) == detect(hf.backend_tokenizer.to_str())
    assert detect(doc["tokenizer_str"])["vocab_type"] == xgrammar.VocabType.BYTE_LEVEL


def test_an_id_without_a_token_keeps_every_later_token_on_its_id() -> None:
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 2, "</s>": 3}, unk_token="a"))
    assert json.loads(tokenizer_info.render(tok.to_str(), 3))["encoded_vocab"] == ["a", "", "b", "</s>"]


@pytest.mark.parametrize("end_id", [None, 4, -1])
def test_an_end_id_that_is_no_token_is_refused(end_id) -> None:
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 2, "</s>": 3}, unk_token="a"))
    with pytest.raises(StepError, match="no token of tokenizer.json"):
        tokenizer_info.render(tok.to_str(), end_id)


def test_a_folder_without_tokenizer_json_is_refused(tmp_path) -> None:
    (tmp_path / "hf").mkdir()
    with pytest.raises(StepError, match="no tokenizer.json"):
        repository.write_repository(_spec(), LLAMA, tmp_path / "repo", tokenizer_src=tmp_path / "hf")


def test_without_a_tokenizer_the_file_is_pending_and_the_parameters_rendered(tmp_path) -> None:
    info = repository.write_repository(_spec(), LLAMA, tmp_path / "repo")
    assert "tensorrt_llm/1/xgrammar_tokenizer_info.json" in info["pending"]
    assert not (tmp_path / "repo/tensorrt_llm/1/xgrammar_tokenizer_info.json").exists()
    assert _params(tmp_path / "repo")["guided_decoding_backend"] == "xgrammar"
