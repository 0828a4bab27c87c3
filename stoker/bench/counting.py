"""What `stoker bench` counts tokens with: the user's tokenizer, the deployment's, or nothing, said loudly.

Without a tokenizer the client can only count stream chunks (non-empty responses); a chunk may hold
several tokens or none, so those figures are not tokens. They are produced only when the user asks
(`--count-chunks`), and every table and summary then says "chunks".
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import InvalidBenchmarkConfig

CHUNKS_WARNING = ("output counted in stream CHUNKS, not tokens (--count-chunks): output_tokens, "
                  "output_tokens_per_s and itl_ms are per chunk, and input_tokens are words")


class NoTokenizer(InvalidBenchmarkConfig):
    """No tokenizer was given or found, and counting chunks was not asked for."""


@dataclass(frozen=True)
class Found:
    """What a deployment lookup found: a tokenizer.json and where from, or (path None) why there is none."""

    tokenizer_json: Path | None
    source: str


@dataclass(frozen=True)
class Counting:
    tokenizer_json: Path | None  # None: stream chunks are counted
    source: str  # where the tokenizer came from, or "--count-chunks"

    @property
    def chunks(self) -> bool:
        return self.tokenizer_json is None

    def to_dict(self) -> dict[str, Any]:
        """The summary's record of it."""
        if self.tokenizer_json is None:
            return {"output_unit": "chunks", "source": self.source}
        digest = hashlib.sha256(Path(self.tokenizer_json).read_bytes()).hexdigest()
        return {"output_unit": "tokens", "source": self.source, "tokenizer": str(self.tokenizer_json),
                "tokenizer_sha256": digest}


def choose(tokenizer: Path | None, count_chunks: bool, lookup: Callable[[], Found]) -> Counting:
    """The user's tokenizer; else chunks if asked; else the deployment's (`lookup`); else a one-line refusal."""
    if tokenizer is not None and count_chunks:
        raise InvalidBenchmarkConfig("give --tokenizer or --count-chunks, not both")
    if tokenizer is not None:
        return Counting(tokenizer, "--tokenizer")
    if count_chunks:
        return Counting(None, "--count-chunks")
    found = lookup()
    if found.tokenizer_json is None:
        raise NoTokenizer(f"no tokenizer to count tokens with ({found.source}); give --tokenizer tokenizer.json, "
                          "or --count-chunks to count stream chunks instead")
    return Counting(found.tokenizer_json, found.source)
