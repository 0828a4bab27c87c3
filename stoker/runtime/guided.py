"""Guided decoding for the reference runtime: TensorRT-LLM's guide inputs, enforced token by token by xgrammar.

The contract is the `tensorrt_llm` model's (TensorRT-LLM 1.2.1, `inflight_batcher_llm`): a request may carry
`guided_decoding_guide_type` (one of GUIDE_TYPES, the names tensorrtllm_backend's docs/guided_decoding.md sends) and
`guided_decoding_guide` (the schema, regex or EBNF grammar as text; nothing for `json`). The engine enforces it with
xgrammar inside its decoder; the reference does the same thing on CPU, as vLLM's structured-output manager does:

- per model: the tokenizer's vocabulary as xgrammar reads it (`TokenizerInfo`, built once, on the first guide: from
  the tokenizer folder, or, as the engine's C++ backend reads it, from TensorRT-LLM's xgrammar tokenizer info file)
  and one `GrammarCompiler`; compiled guides are kept in an LRU keyed by (type, text), so a schema sent a thousand times
  is compiled once;
- per sequence: a `Constraint` (one `GrammarMatcher` and one token bitmask). Before each token is chosen the bitmask
  of what the grammar allows next is filled and applied to that sequence's logits (disallowed tokens to -inf); the
  chosen token then advances the matcher. The constraint is part of choosing a token (`generate.Decoding.choose`),
  so it runs per sequence inside the in-flight batcher's passes and unconstrained sequences never see it.

A guide is compiled where the request is submitted (the request's own thread, before it is queued): a guide that
does not compile is refused with a `GuideError` naming the input, before any token. When no token is allowed (a
grammar that can match nothing, or a complete one whose only way out, the end id, is held back by min_tokens), the
sequence ends there, as if the end id had come, rather than sampling from all -inf.

JSON schemas are compiled without free whitespace (xgrammar's `any_whitespace=False`: `{"a": 1, "b": [2, 3]}`
spacing), so a model that likes whitespace cannot spend its budget on it inside a value it must finish; the engine
compiles the guide with its own settings (unverified which), so the two targets may space JSON differently, never
differ in what parses. xgrammar is imported on the first guide only: a runtime without it serves everything else.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

GUIDE_TYPE_INPUT = "guided_decoding_guide_type"
GUIDE_INPUT = "guided_decoding_guide"
# TensorRT-LLM's GuidedDecodingParams guide types, as its Triton model's input spells them.
GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar")
DEFAULT_CACHE_SIZE = 128
# xgrammar prefixes its C++ errors with a timestamp and a source location; the client needs only the reason.
_LOCATION = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")
# xgrammar 0.2.8 writes a string with minLength/maxLength as characters of this class, which lets a raw control
# character (U+0000-U+001F but CR and LF) into a JSON string; JSON forbids them (RFC 8259 section 7) and Python's
# and browsers' parsers refuse them (seen here: a tiny model wrote "ok\x03K"). Its plain strings use the class
# below, so every string of a schema is narrowed to that before compiling.
_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'


class GuideError(ValueError):
    """A guide the request carries cannot be used; the message names the input."""


def parse_guide(guide_type: Any, guide: Any) -> tuple[str, str] | None:
    """The two Triton inputs (bytes or str, None when absent) as (type, text); None when the request has no guide."""
    guide_type = guide_type.decode("utf-8", "replace") if isinstance(guide_type, bytes) else guide_type
    guide = guide.decode("utf-8", "replace") if isinstance(guide, bytes) else guide
    if guide_type in (None, ""):
        if guide not in (None, ""):
            raise GuideError(f"{GUIDE_INPUT} needs {GUIDE_TYPE_INPUT} (one of {', '.join(GUIDE_TYPES)})")
        return None
    if guide_type not in GUIDE_TYPES:
        raise GuideError(f"{GUIDE_TYPE_INPUT} {guide_type!r}: not one of {', '.join(GUIDE_TYPES)}")
    if guide_type != "json" and not guide:
        raise GuideError(f"{GUIDE_INPUT} is required with {GUIDE_TYPE_INPUT} {guide_type}")
    return guide_type, guide or ""


def _json_schema_ebnf(schema: str) -> str:
    """The schema as xgrammar's EBNF (no free whitespace, no properties beyond the schema's), its strings JSON's."""
    import xgrammar

    ebnf = str(xgrammar.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True))
    return ebnf.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR)


def _reason(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return _LOCATION.sub("", lines[0]) if lines else type(exc).__name__


class Grammars:
    """One model's grammar compiler: its tokenizer's info (built once), and compiled guides in an LRU."""

    def __init__(self, tokenizer_dir: Path, vocab_size: int, cache_size: int = DEFAULT_CACHE_SIZE,
                 tokenizer: Any = None, tokenizer_info_path: Path | None = None) -> None:
        # vocab_size: the model's logits width (lm_head), which may exceed the tokenizer's; the padding is masked.
        # tokenizer_info_path: TensorRT-LLM's xgrammar tokenizer info file; when given, the vocabulary is read from it
        # and tokenizer_dir is not used, as the engine's C++ backend ignores tokenizer_dir for guided decoding.
        self.tokenizer_dir, self.vocab_size, self.cache_size = Path(tokenizer_dir), vocab_size, cache_size
        self.tokenizer_info_path = Path(tokenizer_info_path) if tokenizer_info_path else None
        self._tokenizer = tokenizer
        self._compiler: Any = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        # One lock for the compiler and the cache: a guide is compiled once even when it arrives on many threads.
        self._lock = threading.Lock()
        self.compiled = 0  # guides compiled (not served from the cache), for tests and logs

    def _xgrammar_compiler(self) -> Any:
        if self._compiler is None:
            # Both failures are the server's, not the request's: RuntimeError (an internal error), never GuideError.
            try:
                import xgrammar
            except ImportError:
                raise RuntimeError("guided decoding needs xgrammar, which this runtime lacks") from None
            tokenizer = self._tokenizer
            if tokenizer is None and self.tokenizer_info_path is not None:
                info = tokenizer_info_from_file(self.tokenizer_info_path, self.vocab_size)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
                return self._compiler
            if tokenizer is None:
                from transformers import AutoTokenizer

                try:
                    tokenizer = AutoTokenizer.from_pretrained(str(self.tokenizer_dir))
                except Exception as exc:  # noqa: BLE001 -- e.g. an engine folder, which holds no tokenizer
                    raise RuntimeError(f"guided decoding needs the model's tokenizer in {self.tokenizer_dir} (the "
                                       f"tokenizer_dir parameter): {type(exc).__name__}: {_reason(exc)}") from None
            info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
            # The LRU below is the cache; xgrammar's own would hold every guide ever seen.
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def compile(self, guide_type: str, guide: str) -> Any:
        """The compiled grammar of one guide (from the cache when seen); GuideError when it does not compile."""
        key = (guide_type, guide)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            compiler = self._xgrammar_compiler()
            try:
                if guide_type == "json":
                    grammar = compiler.compile_builtin_json_grammar()
                elif guide_type == "json_schema":
                    json.loads(guide)  # a schema that is no JSON is named as such, not as a grammar error
                    grammar = compiler.compile_grammar(_json_schema_ebnf(guide))
                elif guide_type == "regex":
                    grammar = compiler.compile_regex(guide)
                elif guide_type == "ebnf_grammar":
                    grammar = compiler.compile_grammar(guide)
                else:
                    raise GuideError(f"{GUIDE_TYPE_INPUT} {guide_type!r}: not one of {', '.join(GUIDE_TYPES)}")
            except GuideError:
                raise
            except ValueError as exc:  # json.loads
                raise GuideError(f"{GUIDE_INPUT}: the JSON schema is not valid JSON: {exc}") from None
            except Exception as exc:  # noqa: BLE001 -- xgrammar raises RuntimeError (and subclasses) for any bad guide
                raise GuideError(f"{GUIDE_INPUT}: the {guide_type} guide does not compile: {_reason(exc)}") from None
            if _admits_nothing(grammar, self.vocab_size):
                # e.g. a $ref loop ({"$ref": "#/$defs/a"} with a = {"$ref": "#/$defs/a"}): it compiles to a rule
                # that is only itself, which no string matches.
                raise GuideError(f"{GUIDE_INPUT}: the {guide_type} guide admits no output at all (a rule that only "
                                 "refers to itself, such as a $ref loop?)")
            self.compiled += 1
            self._cache[key] = grammar
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return grammar

    def constraint(self, guide_type: str, guide: str, stop_ids: Sequence[int]) -> Constraint:
        """A fresh constraint for one sequence. ``stop_ids``: the tokens that end it (its end id, one-token stop
        words); the grammar allows them once it is complete, and only then."""
        return Constraint(self.compile(guide_type, guide), [t for t in stop_ids if 0 <= t < self.vocab_size],
                          self.vocab_size)


def tokenizer_info_from_file(path: Path, vocab_size: int) -> Any:
    """xgrammar's TokenizerInfo from TensorRT-LLM's tokenizer info file (encoded_vocab, tokenizer_str,
    stop_token_ids; stoker/gpu/tokenizer_info.py writes it), built as the engine builds its own: the vocabulary type
    and prefix space detected from tokenizer_str (RAW and none without one), the vocabulary padded to the model's
    logits width, the file's stop ids (TensorRT-LLM cpp/tensorrt_llm/batch_manager/guidedDecoder.cpp, the
    GuidedDecoder constructor). xgrammar's from_huggingface also second-guesses the type from the vocabulary; the
    engine does not, so neither does this. RuntimeError (the server's, never the request's) naming the parameter
    when the file cannot be used."""
    import xgrammar

    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        encoded_vocab, stop_ids = list(doc["encoded_vocab"]), [int(i) for i in doc["stop_token_ids"]]
        backend = doc.get("tokenizer_str")
        meta = (xgrammar.TokenizerInfo._detect_metadata_from_hf(backend) if backend
                else {"vocab_type": xgrammar.VocabType.RAW, "add_prefix_space": False})
    except Exception as exc:  # noqa: BLE001 -- missing, not JSON, a key missing, a tokenizer_str xgrammar refuses
        raise RuntimeError(f"guided decoding needs the tokenizer info in {path} (the xgrammar_tokenizer_info_path "
                           f"parameter): {type(exc).__name__}: {_reason(exc)}") from None
    return xgrammar.TokenizerInfo(encoded_vocab, vocab_type=meta["vocab_type"], vocab_size=vocab_size,
                                  stop_token_ids=stop_ids, add_prefix_space=meta["add_prefix_space"])


def _admits_nothing(grammar: Any, vocab_size: int) -> bool:
    """Whether not even a first token (or the empty string) matches: a guide that cannot produce any output."""
    import xgrammar

    matcher = xgrammar.GrammarMatcher(grammar, terminate_without_stop_token=True)
    if matcher.is_completed():
        return False
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    return not bool(bitmask.any())


class Constraint:
    """One sequence's place in its grammar: which tokens may come next (`mask`), and the token that came (`accept`)."""

    def __init__(self, grammar: Any, stop_ids: list[int], vocab_size: int) -> None:
        import xgrammar

        self._xgr = xgrammar
        # Without any stop token the grammar's end is the sequence's end: nothing more is allowed once complete.
        self.matcher = xgrammar.GrammarMatcher(grammar, override_stop_tokens=stop_ids or None,
                                               terminate_without_stop_token=not stop_ids)
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: torch.Tensor) -> torch.Tensor | None:
        """``logits`` [vocab] with every token the grammar does not allow next at -inf; None when none is allowed."""
        if self.matcher.is_terminated():
            return None
        self.matcher.fill_next_token_bitmask(self.bitmask)
        masked = logits.clone()
        self._xgr.apply_token_bitmask_inplace(masked, self.bitmask)
        if not torch.isfinite(masked).any():
            return None
        return masked

    def accept(self, token: int) -> None:
        """Advance past the token chosen from the masked logits (always allowed: the mask admitted it)."""
        if not self.matcher.accept_token(int(token)):
            raise RuntimeError(f"the grammar refused token {token}, which its own mask allowed")
