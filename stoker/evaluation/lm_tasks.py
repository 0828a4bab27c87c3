"""stoker's local lm-evaluation-harness tasks: their YAML and data ship in the package (stoker/data/lm_eval/),
so an evaluation never reaches the network. Pure: the plan checks a task name without importing lm-eval."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stoker.errors import StokerError

TASKS: dict[str, str] = {
    "stoker_cloze": "40 everyday sentences, pick the sensible ending of four (acc, acc_norm)",
}


class UnknownTaskError(StokerError, ValueError):
    """The task is not one of stoker's local lm-eval tasks."""


def task_dir() -> Path:
    """Where the tasks' YAML and data live: lm-eval's TaskManager(include_path=...)."""
    return Path(__file__).resolve().parent.parent / "data" / "lm_eval"


def check_task(name: str) -> None:
    """Refuse a task stoker does not ship, in one line that names the known ones."""
    if name not in TASKS:
        raise UnknownTaskError(f"unknown lm-eval task {name!r}; known tasks: {', '.join(sorted(TASKS))}")


def read_docs(data_file: str) -> list[dict[str, Any]]:
    """The docs of a task's JSONL file (one JSON object a line), relative to task_dir()."""
    with open(task_dir() / data_file, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_dataset(data_file: str, **_metadata: Any):  # -> datasets.DatasetDict
    """lm-eval's `custom_dataset` hook: the docs as the task's test split. A path relative to the package, as
    `dataset_path: json` would resolve `data_files` against the working directory; lm-eval also passes the
    task's metadata (version), unused here."""
    import datasets  # lm-eval's dependency, only in its worker

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(read_docs(data_file))})
