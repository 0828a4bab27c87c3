"""The evaluation set: held-out text cut into perplexity windows and greedy prompts, as token ids.

Pure apart from reading files: the text comes from the spec (a file, or a file already downloaded
from a Hub dataset) or stoker's bundled evaluation.txt, which is kept apart from calibration.txt.
The same token ids go to the candidate (through its endpoint) and to the baseline (a child process),
so both are scored on exactly the same positions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..storage.digest import json_digest

DEFAULT_TEXT = Path(__file__).resolve().parent.parent / "data" / "evaluation.txt"


class EvalDataError(ValueError):
    """The evaluation text cannot give what the spec asks for (missing, empty, too short)."""


@dataclass(frozen=True)
class EvalSet:
    windows: list[list[int]]  # perplexity: every token after the first is scored
    prompts: list[list[int]]  # greedy agreement: the first prompt_tokens of a window
    greedy_tokens: int
    source: str  # where the text came from, for the report

    @property
    def digest(self) -> str:
        """What the measurement depends on: the ids themselves, not the file they came from."""
        return json_digest({"windows": self.windows, "prompts": self.prompts, "greedy_tokens": self.greedy_tokens})

    def to_dict(self) -> dict:
        return {"windows": self.windows, "prompts": self.prompts, "greedy_tokens": self.greedy_tokens,
                "source": self.source}

    @classmethod
    def from_dict(cls, raw: dict) -> EvalSet:
        return cls(windows=raw["windows"], prompts=raw["prompts"], greedy_tokens=raw["greedy_tokens"],
                   source=raw["source"])


def read_text(path: Path, text_field: str = "text") -> str:
    """A .txt file as is; a .jsonl file's `text_field` values joined by blank lines."""
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise EvalDataError(f"evaluation text {path}: no such file") from None
    except UnicodeDecodeError:
        raise EvalDataError(f"evaluation text {path}: not UTF-8 text") from None
    if path.suffix == ".jsonl":
        rows = []
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line).get(text_field)
            except (json.JSONDecodeError, AttributeError):
                raise EvalDataError(f"evaluation text {path}:{n}: not a JSON object") from None
            if not isinstance(value, str):
                raise EvalDataError(f"evaluation text {path}:{n}: no string field {text_field!r}")
            rows.append(value)
        raw = "\n\n".join(rows)
    if not raw.strip():
        raise EvalDataError(f"evaluation text {path} is empty")
    return raw


def cut(ids: list[int], window_tokens: int, max_windows: int, prompts: int, prompt_tokens: int,
        greedy_tokens: int, source: str) -> EvalSet:
    """Consecutive, non-overlapping windows; prompts are the windows' openings, reused in turn."""
    if len(ids) < window_tokens:
        raise EvalDataError(f"evaluation text {source} has {len(ids)} tokens, shorter than one window "
                            f"of {window_tokens} (evaluation.window_tokens)")
    windows = [ids[i:i + window_tokens] for i in range(0, len(ids) - window_tokens + 1, window_tokens)][:max_windows]
    openings = [w[:prompt_tokens] for w in windows]
    return EvalSet(windows=windows, prompts=[openings[i % len(openings)] for i in range(prompts)],
                   greedy_tokens=greedy_tokens, source=source)


def same_text(a: str, b: str) -> bool:
    """Whitespace-insensitive equality, or one containing the other: scoring on calibration text flatters."""
    na, nb = " ".join(a.split()), " ".join(b.split())
    return bool(na) and bool(nb) and (na in nb or nb in na)
