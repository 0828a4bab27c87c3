"""Guided decoding in the reference runtime (stoker/runtime/guided.py): xgrammar's mask per token, per sequence, in
the in-flight batcher, on a real tiny model with a real byte-level BPE tokenizer saved beside its weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
xgrammar = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from test_runtime import NO_END, hf_greedy, hf_model, write_artifact

from stoker.runtime.batch import Batcher
from stoker.runtime.generate import generate
from stoker.runtime.guided import GUIDE_INPUT, Grammars, GuideError, parse_guide
from stoker.runtime.model import load_model

VOCAB = 320  # the model's logits; the tokenizer has fewer tokens, so xgrammar must mask the padding too
END = 1  # </s>
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
        "size": {"enum": ["small", "large"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["name", "ok", "size", "tags"],
    "additionalProperties": False,
}
CORPUS = ['{"name": "abc", "ok": true, "size": "small", "tags": ["x", "yz"]}', '[1, 2, 3]', "false null 42",
          "the quick brown fox jumps over the lazy dog"]


def _tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<s>", "</s>"]))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(model, tokenizer, grammars): the artifact folder holds the tokenizer, as a reference build's does."""
    root = write_artifact(hf_model(vocab_size=VOCAB), tmp_path_factory.mktemp("guided"), end_id=END)
    tokenizer = _tokenizer()
    tokenizer.save_pretrained(root)
    model = load_model(root, num_threads=2)
    return model, tokenizer, Grammars(root, model.vocab_size)


def _prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(t) for t in ("Describe a thing as JSON:", "quick fox", "{", "lazy dog null")]


def _valid_prefix(grammars: Grammars, text: str) -> bool:
    matcher = xgrammar.GrammarMatcher(grammars.compile("json_schema", json.dumps(SCHEMA)))
    return matcher.accept_string(text)


def test_constrained_and_free_sequences_share_passes(served) -> None:
    """Every constrained output parses and validates; the free ones, decoded in the same passes, are unchanged."""
    model, tokenizer, grammars = served
    prompts = _prompts(tokenizer)
    free_alone = [list(generate(model, p, 20, end_id=NO_END)) for p in prompts]
    schema = json.dumps(SCHEMA)
    batcher = Batcher(model, max_batch=8)
    streams = []
    try:
        for i, prompt in enumerate(prompts):
            streams.append(("free", batcher.submit(prompt, 20, NO_END)))
            for seed in range(2):  # greedy, then sampled: both must follow the grammar
                sampling = {} if seed == 0 else {"temperature": 1.0, "top_k": 0, "top_p": 0.95, "seed": i}
                constraint = grammars.constraint("json_schema", schema, [END])
                streams.append(("guided", batcher.submit(prompt, 80, END, constraint=constraint, **sampling)))
        batcher.start()
        outputs = [(kind, list(stream)) for kind, stream in streams]
    finally:
        batcher.stop()
    assert batcher.largest_step == 8, "constrained and free sequences were never decoded together"
    assert [ids for kind, ids in outputs if kind == "free"] == free_alone
    assert free_alone[0] == hf_greedy(hf_model(vocab_size=VOCAB), prompts[0], 20)
    guided = [tokenizer.decode(ids, skip_special_tokens=True) for kind, ids in outputs if kind == "guided"]
    for text in guided:
        jsonschema.validate(json.loads(text), SCHEMA)  # every one finished within its budget, and is valid
    assert grammars.compiled == 1, "one schema, compiled once"


def test_a_lone_constrained_sequence_ends_with_the_grammar(served) -> None:
    model, tokenizer, grammars = served
    batcher = Batcher(model, max_batch=1).start()
    try:
        ids = list(batcher.submit(_prompts(tokenizer)[1], 80, END,
                                  constraint=grammars.constraint("regex", r"(yes|no)!", [END])))
    finally:
        batcher.stop()
    assert tokenizer.decode(ids) in ("yes!", "no!")


def test_no_token_can_satisfy_ends_the_sequence_instead_of_hanging(served) -> None:
    """A complete grammar whose only way out (the end id) min_tokens holds back ends at once ("stop"); a grammar that
    never completes runs to its budget ("length")."""
    model, tokenizer, grammars = served
    prompt = _prompts(tokenizer)[0]
    batcher = Batcher(model, max_batch=2).start()
    try:
        held = batcher.submit(prompt, 30, END, min_new_tokens=10, constraint=grammars.constraint("regex", "ok", [END]))
        endless = batcher.submit(prompt, 30, END, constraint=grammars.constraint("ebnf_grammar", 'root ::= "a" root', []))
        held_ids, endless_ids = list(held), list(endless)
    finally:
        batcher.stop()
    assert tokenizer.decode(held_ids) == "ok"
    assert len(endless_ids) == 30 and set(tokenizer.decode(endless_ids)) == {"a"}


def test_an_unfinished_output_is_a_prefix_the_grammar_accepts(served) -> None:
    model, tokenizer, grammars = served
    ids = []
    batcher = Batcher(model, max_batch=1).start()
    try:
        ids = list(batcher.submit(_prompts(tokenizer)[2], 6, END,
                                  constraint=grammars.constraint("json_schema", json.dumps(SCHEMA), [END])))
    finally:
        batcher.stop()
    assert len(ids) == 6
    assert _valid_prefix(grammars, tokenizer.decode(ids))


@pytest.mark.parametrize("guide_type, guide, reason", [
    ("json_schema", '{"type": "nonsense"}', "does not compile: Unsupported type"),
    ("json_schema", '{"$ref": "#/$defs/missing"}', "does not compile"),
    ("json_schema", "{not json", "not valid JSON"),
    ("regex", "([", "does not compile"),
    ("json_schema", json.dumps({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}),
     "admits no output"),
    ("ebnf_grammar", "root ::= ", "does not compile"),
])
def test_a_guide_that_does_not_compile_is_refused_naming_the_input(served, guide_type, guide, reason) -> None:
    _, _, grammars = served
    with pytest.raises(GuideError, match=reason) as err:
        grammars.constraint(guide_type, guide, [END])
    assert str(err.value).startswith(GUIDE_INPUT)


def test_the_two_inputs_are_read_as_tensorrt_llm_defines_them() -> None:
    assert parse_guide(None, None) is None
    assert parse_guide(b"json", None) == ("json", "")
    assert parse_guide(b"json_schema", b'{"type": "object"}') == ("json_schema", '{"type": "object"}')
    for bad in ((b"yaml", b"x"), (None, b"x"), (b"regex", None)):
        with pytest.raises(GuideError, match="guided_decoding_guide"):
            parse_guide(*bad)


def test_the_cache_keeps_the_most_recent_guides(served) -> None:
    model, tokenizer, _ = served
    grammars = Grammars(Path("/nonexistent"), model.vocab_size, cache_size=2, tokenizer=tokenizer)
    for guide in ("a", "b", "a", "c", "a", "b"):
        grammars.compile("regex", guide)
    assert grammars.compiled == 4  # a, b, c, then b again (pushed out by c while a stayed recent)


def test_a_bounded_string_admits_no_raw_control_character(served) -> None:
    """xgrammar 0.2.8 lets U+0000-U+001F into a string with maxLength; JSON does not (guided.py narrows it)."""
    _, _, grammars = served
    grammar = grammars.compile("json_schema", json.dumps({"type": "string", "maxLength": 4}))
    assert xgrammar.GrammarMatcher(grammar).accept_string('"ab"')
    assert not xgrammar.GrammarMatcher(grammar).accept_string('"a\x03')
    assert not xgrammar.GrammarMatcher(grammar).accept_string('"a\t')


def test_a_missing_tokenizer_is_the_servers_error_not_the_requests(tmp_path) -> None:
    """An engine stand-in's folder has no tokenizer: an internal error naming tokenizer_dir, not a 400 for the guide."""
    with pytest.raises(RuntimeError, match="tokenizer_dir") as err:
        Grammars(tmp_path, VOCAB).compile("json", "")
    assert not isinstance(err.value, GuideError) and GUIDE_INPUT not in str(err.value)


def test_the_engines_tokenizer_info_file_constrains_as_the_tokenizer_folder(served, tmp_path) -> None:
    """The engine stand-in's folder has no tokenizer: Grammars built from the xgrammar tokenizer info file the engine
    repository carries (stoker/gpu/tokenizer_info.py) allow, token by token, what Grammars from the folder allow."""
    import torch

    from stoker.gpu import tokenizer_info

    model, tokenizer, from_folder = served
    info = tmp_path / "xgrammar_tokenizer_info.json"
    # Rendered from the folder's tokenizer.json, as the package step renders it.
    info.write_text(tokenizer_info.render((from_folder.tokenizer_dir / "tokenizer.json").read_text(), END))
    from_file = Grammars(tmp_path / "no-tokenizer-here", model.vocab_size, tokenizer_info_path=info)
    a, b = from_folder.compile("json", "").tokenizer_info, from_file.compile("json", "").tokenizer_info
    assert (a.vocab_type, a.add_prefix_space, a.vocab_size) == (b.vocab_type, b.add_prefix_space, b.vocab_size)
    # from_huggingface pads the list to the logits width with empty tokens; the engine, like the file's, does not
    # (TokenizerInfo(encoded_vocab, ..., vocab_size padded)); the masks below show the padding is refused by both.
    n = len(b.decoded_vocab)
    assert a.decoded_vocab[:n] == b.decoded_vocab and set(a.decoded_vocab[n:]) <= {b""} and b.stop_token_ids == [END]
    guides = [("json_schema", json.dumps(SCHEMA)), ("json", ""), ("regex", r"(yes|no)!"),
              ("ebnf_grammar", 'root ::= "a" root | "b"')]

    def walk(grammars: Grammars, guide_type: str, guide: str, tokens: list[int] | None) -> tuple[list, list[int]]:
        """The allowed set before each token, along ``tokens`` (None: the highest allowed id each step, 12 steps)."""
        constraint, allowed, taken = grammars.constraint(guide_type, guide, [END]), [], []
        for step in range(len(tokens) if tokens is not None else 12):
            masked = constraint.mask(torch.zeros(model.vocab_size))
            allowed.append(None if masked is None else torch.isfinite(masked).nonzero().flatten().tolist())
            if masked is None:
                break
            token = tokens[step] if tokens is not None else int(torch.isfinite(masked).nonzero()[-1])
            constraint.accept(token)
            taken.append(token)
        return allowed, taken

    for guide_type, guide in guides:
        allowed, taken = walk(from_folder, guide_type, guide, None)
        assert len(taken) > 1 and all(len(a) < model.vocab_size for a in allowed if a), guide_type  # it constrains
        assert walk(from_file, guide_type, guide, taken) == (allowed[:len(taken)], taken), guide_type
    # And a whole generation: the same ids from either.
    prompt = _prompts(tokenizer)[0]
    outs = []
    for grammars in (from_folder, from_file):
        batcher = Batcher(model, max_batch=1).start()
        try:
            outs.append(list(batcher.submit(prompt, 40, END, constraint=grammars.constraint(
                "json_schema", json.dumps(SCHEMA), [END]))))
        finally:
            batcher.stop()
    assert outs[0] == outs[1] and outs[0]


def test_a_missing_tokenizer_info_file_is_the_servers_error_naming_the_parameter(tmp_path) -> None:
    with pytest.raises(RuntimeError, match="xgrammar_tokenizer_info_path") as err:
        Grammars(tmp_path, VOCAB, tokenizer_info_path=tmp_path / "absent.json").compile("json", "")
    assert not isinstance(err.value, GuideError)
