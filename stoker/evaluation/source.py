"""Where the evaluation text comes from (spec file, Hub dataset, bundled default), and the checks of
it that run at plan time and before any heavy step, each a one-line refusal."""

from __future__ import annotations

from pathlib import Path

from ..errors import SpecError
from ..cache.keys import calibration_file
from ..spec.schema import Spec
from .data import DEFAULT_TEXT, EvalDataError, EvalSet, cut, read_text, same_text


def text_path(spec: Spec, download_dir: Path) -> tuple[Path, str]:
    """The evaluation text's local file and a label for the report; downloads a Hub dataset file."""
    ev = spec.evaluation
    if ev.dataset is not None:
        from ..storage import hub
        from ..storage.source import hub_endpoint, hub_token

        d = ev.dataset
        path = hub.dataset_file(d.repo_id, d.revision, d.path, hub_endpoint(spec.model), download_dir,
                                hub_token(spec.model))
        return path, f"hf dataset {d.repo_id}@{d.revision}:{d.path}"
    path = ev.text_file or DEFAULT_TEXT
    return path, ("stoker's bundled evaluation.txt" if ev.text_file is None else str(path))


def load_text(spec: Spec, download_dir: Path) -> tuple[str, str, list[str]]:
    """(text, source label, warnings); SpecError (one line) for a missing, empty or unreadable text."""
    path, label = text_path(spec, download_dir)
    try:
        text = read_text(path, spec.evaluation.dataset.text_field if spec.evaluation.dataset else "text")
    except EvalDataError as exc:
        raise SpecError(f"evaluation: {exc}") from None
    warnings = []
    calibration = calibration_file(spec)
    if spec.quantization.format != "none" and calibration.is_file() and same_text(text, calibration.read_text()):
        warnings.append(f"evaluation text {label} is the calibration text ({calibration}): the measured "
                        "perplexity and agreement will be optimistic")
    return text, label, warnings


def check_length(spec: Spec, text: str, label: str, tokens: int | None = None) -> None:
    """Shorter than one window: exact with a token count, else a bound (a token covers at least one byte)."""
    window = spec.evaluation.window_tokens
    have = tokens if tokens is not None else len(text.encode())
    if have < window:
        unit = "tokens" if tokens is not None else "bytes"
        raise SpecError(f"evaluation: text {label} has {have} {unit}, shorter than one window of {window} tokens "
                        "(evaluation.window_tokens)")


def evalset(spec: Spec, tokenizer_json: Path, download_dir: Path) -> tuple[EvalSet, list[str]]:
    """Tokenize the evaluation text with the model's own tokenizer and cut windows and prompts."""
    from tokenizers import Tokenizer

    text, label, warnings = load_text(spec, download_dir)
    ids = Tokenizer.from_file(str(tokenizer_json)).encode(text, add_special_tokens=False).ids
    check_length(spec, text, label, len(ids))
    ev = spec.evaluation
    try:
        return cut(ids, ev.window_tokens, ev.max_windows, ev.prompts, ev.prompt_tokens, ev.greedy_tokens,
                   label), warnings
    except EvalDataError as exc:
        raise SpecError(f"evaluation: {exc}") from None


def plan_check(spec: Spec, download_dir: Path) -> list[str]:
    """What `stoker plan` and preflight refuse about the evaluation before any download of weights."""
    if not spec.evaluation.enabled:
        return []
    text, label, warnings = load_text(spec, download_dir)
    check_length(spec, text, label)
    return warnings
