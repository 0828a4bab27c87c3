"""Targets say what differs; the rest is shared: no code outside stoker/targets compares a target's name.

What a target does differently is one of its traits (stoker/target_traits.py, the one table that spells the names);
stoker, tasks and flows ask `target_traits.of(spec.target)`, never `spec.target == "tensorrt"`. The scan reads
the code, not its text: a name in a message or a data key (matrix.json's "tensorrt" version) is not a comparison.
"""

from __future__ import annotations

import ast
from pathlib import Path

from stoker import target_traits, targets

ROOT = Path(__file__).resolve().parents[2]
NAMES = frozenset(target_traits.TRAITS)
# Where the names may be spelled: the table itself and the targets, each of which is one of them.
ALLOWED = (ROOT / "stoker" / "target_traits.py", ROOT / "stoker" / "targets")


def _names_in(node: ast.AST) -> list[str]:
    """The target names a node is or lists (a literal name, or a tuple/list/set of literals)."""
    if isinstance(node, ast.Constant) and node.value in NAMES:
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in NAMES]
    return []


def name_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) for every comparison with a target's name, list of target names, per-target dict, default
    `target` argument or match case naming a target, in ``source``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            named = [n for operand in (node.left, *node.comparators) for n in _names_in(operand)]
            if named:
                found.append((node.lineno, f"compares with {', '.join(named)}"))
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and node.elts and \
                len(_names_in(node)) == len(node.elts):
            found.append((node.lineno, "lists targets by name"))
        elif isinstance(node, ast.Dict) and node.keys and all(k is not None and _names_in(k) for k in node.keys):
            found.append((node.lineno, "a table keyed by target names"))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            positional = [*args.posonlyargs, *args.args]
            pairs = [*zip(positional[len(positional) - len(args.defaults):], args.defaults),
                     *((a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None)]
            found += [(d.lineno, f"defaults {a.arg} to {d.value}") for a, d in pairs if _names_in(d)
                      and isinstance(d, ast.Constant)]
        elif isinstance(node, ast.MatchValue) and _names_in(node.value):
            found.append((node.lineno, f"matches {node.value.value}"))
    return sorted(set(found))


def _sources() -> list[Path]:
    files = [p for d in ("stoker", "tasks", "flows") for p in sorted((ROOT / d).rglob("*.py"))]
    return [p for p in files if not any(p == a or a in p.parents for a in ALLOWED)]


def test_no_code_outside_the_targets_compares_a_target_name():
    found = [f"{p.relative_to(ROOT)}:{line}: {what}" for p in _sources() for line, what in name_uses(p.read_text())]
    assert not found, ("ask the target's traits (stoker/target_traits.py) instead of its name:\n" + "\n".join(found))


def test_the_scan_finds_each_way_of_naming_a_target():
    source = '''
GPU = ("tensorrt", "pytorch")
ENGINES = {"tensorrt": 1}
if spec.target == "tensorrt" or target != "reference" or spec.target in ("pytorch", "tensorrt"):
    pass
def gap(engine_bytes, target="pytorch", *, other="tensorrt"):
    pass
match spec.target:
    case "reference":
        pass
'''
    assert name_uses(source) == [(2, "lists targets by name"), (3, "a table keyed by target names"),
                                 (4, "compares with pytorch, tensorrt"), (4, "compares with reference"),
                                 (4, "compares with tensorrt"), (4, "lists targets by name"),
                                 (6, "defaults other to tensorrt"), (6, "defaults target to pytorch"),
                                 (9, "matches reference")]
    # Data and messages are not comparisons: TRT-LLM's own `backend: pytorch`, the image's TensorRT version.
    assert name_uses('cfg = {"backend": "pytorch", "max": 1}\nv = e["tensorrt"]\nmsg = f"use target pytorch"\n') == []


def test_each_target_takes_its_name_place_and_layout_from_its_traits():
    assert set(targets.names()) >= set(target_traits.TRAITS)
    for name, traits in target_traits.TRAITS.items():
        target = targets.get(name)
        assert target.traits is traits
        assert (target.name, target.runs_on, target.layout) == (traits.name, traits.runs_on, traits.layout)
    assert target_traits.of("a-target-registered-elsewhere") == target_traits.Traits("a-target-registered-elsewhere")
