"""stoker's local lm-eval tasks: the registry, the plan-time refusal, and the data shipped in the package."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from stoker.errors import StokerError
from stoker.evaluation.lm_tasks import TASKS, UnknownTaskError, check_task, read_docs, task_dir


class _TaskYamlLoader(yaml.SafeLoader):
    """lm-eval's `!function module.name` tag, read as its text."""


_TaskYamlLoader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))


def _configs() -> dict[str, dict]:
    configs = [yaml.load(path.read_text(), Loader=_TaskYamlLoader) for path in sorted(task_dir().glob("*.yaml"))]
    return {config["task"]: config for config in configs}


def test_every_registered_task_ships_its_yaml_and_data() -> None:
    configs = _configs()
    assert set(configs) == set(TASKS) and TASKS["stoker_cloze"]
    for config in configs.values():
        assert config["custom_dataset"] == "stoker.evaluation.lm_tasks.load_dataset"  # never dataset_path: offline
        assert (task_dir() / config["dataset_kwargs"]["data_file"]).is_file()


def test_check_task_accepts_known_and_refuses_unknown_in_one_line() -> None:
    check_task("stoker_cloze")
    with pytest.raises(UnknownTaskError) as refused:
        check_task("hellaswag")
    assert isinstance(refused.value, ValueError) and isinstance(refused.value, StokerError)
    assert str(refused.value) == "unknown lm-eval task 'hellaswag'; known tasks: stoker_cloze"


def test_cloze_docs_have_exactly_one_correct_ending() -> None:
    config = _configs()["stoker_cloze"]
    assert config["output_type"] == "multiple_choice"
    assert [m["metric"] for m in config["metric_list"]] == ["acc", "acc_norm"]
    docs = read_docs(config["dataset_kwargs"]["data_file"])
    assert len(docs) == 40 and [d["id"] for d in docs] == list(range(40))
    for doc in docs:
        endings = doc["endings"]
        assert len(endings) == 4 and len(set(endings)) == 4, doc  # one correct, three distinct distractors
        assert isinstance(doc["label"], int) and 0 <= doc["label"] < 4, doc
        # lm-eval joins context and choice with one space (target_delimiter)
        assert doc["context"] == doc["context"].strip() and all(e == e.strip() and e for e in endings), doc
    # the answer is not always in the same position
    assert {d["label"] for d in docs} == {0, 1, 2, 3}


def test_registry_imports_neither_lm_eval_nor_datasets() -> None:
    """The plan checks task names in the orchestrator, which never loads lm-eval's stack."""
    code = ("import sys, stoker.evaluation.lm_tasks; "
            "print(sorted(m for m in ('lm_eval', 'datasets', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
