"""Which token ids end a generation, and TensorRT-LLM's stop-word tensor layout.

Standard library only: stoker imports it (build step, GPU rendering), and it is copied beside the
preprocessing and tensorrt_llm model.py files, which run inside Triton without stoker installed.

Semantics, as TensorRT-LLM's LLM API defines them (vLLM does the same):
- `end_id` is one id: the tokenizer's eos token (what TRT-LLM's SamplingParams takes), else the first
  eos id of generation_config.json, else the first of config.json.
- Every other eos id, from generation_config.json, config.json and the tokenizer in that order,
  without repeats, is a one-token stop word. Llama 3.1 Instruct: end_id 128009 (<|eot_id|>),
  stop words [128001], [128008].
- TRT-LLM never returns end_id, but returns a matched stop word (it counts in sequence_length);
  transformers' generate returns both.
- `min_tokens` holds back end_id only, not stop words (TRT-LLM's min-length penalty).

The stop-word tensor of one request is TRT-LLM's [2, N] int32 layout: row 0 the words' ids
concatenated, row 1 each word's end offset (cumulative); row 0 is padded with 0 and row 1 with -1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple


class StopIds(NamedTuple):
    end_id: int | None
    stop_ids: tuple[int, ...]  # each one a one-token stop word


def ids(value: Any) -> list[int]:
    """An HF config's token id field (an int, a list of ints or null) as a list."""
    values = value if isinstance(value, list) else [value]
    return [int(v) for v in values if isinstance(v, int) and not isinstance(v, bool)]


def collect(generation: dict, config: dict, tokenizer_eos: int | None) -> StopIds:
    """end_id and the other eos ids of a model (see the module docstring for the order)."""
    from_configs = ids(generation.get("eos_token_id")) + ids(config.get("eos_token_id"))
    every = list(dict.fromkeys(from_configs + ids(tokenizer_eos)))
    if not every:
        return StopIds(None, ())
    end_id = tokenizer_eos if tokenizer_eos is not None else every[0]
    return StopIds(end_id, tuple(i for i in every if i != end_id))


def to_word_lists(batch: Sequence[Sequence[Sequence[int]]]) -> list[list[list[int]]]:
    """Per request, its words in TRT-LLM's [2, N] layout; one N for the whole batch (at least 1)."""
    flat = [[t for word in words for t in word] for words in batch]
    offsets = []
    for words in batch:
        ends, total = [], 0
        for word in words:
            total += len(word)
            ends.append(total)
        offsets.append(ends)
    width = max([1, *(len(f) for f in flat)])
    return [[f + [0] * (width - len(f)), o + [-1] * (width - len(o))] for f, o in zip(flat, offsets)]


def from_word_list(rows: Sequence[Sequence[int]]) -> list[list[int]]:
    """The words of one request's [2, N] stop-word tensor (the inverse of `to_word_lists`)."""
    if len(rows) != 2:
        raise ValueError(f"a stop word list has 2 rows (ids, offsets), got {len(rows)}")
    flat, offsets = [int(t) for t in rows[0]], [int(o) for o in rows[1]]
    words, start = [], 0
    for end in offsets:
        if end < 0:
            break
        if not start <= end <= len(flat):
            raise ValueError(f"stop word offset {end} outside {start}..{len(flat)}")
        if end > start:
            words.append(flat[start:end])
        start = end
    return words

