"""The import layers (pyproject.toml's [tool.importlinter]) and no import circle in stoker/, tasks/ or flows/.

Imports inside functions count: grimp reads every import statement of a module, wherever it sits.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("stoker", "tasks", "flows")


def test_lint_imports_keeps_every_contract():
    lint = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"lint-imports exited {done.returncode}:\n{done.stdout}\n{done.stderr}"


def test_no_contract_lets_its_rule_be_broken_indirectly():
    """allow_indirect_imports would let stoker.gpu reach stoker.serving through any third module (it once did,
    through stoker.plan.rows): each forbidden contract holds for chains of imports too."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    loose = [c["name"] for c in config["contracts"] if c.get("allow_indirect_imports")]
    assert not loose, f"contracts with allow_indirect_imports: {loose}"


def test_every_stoker_module_has_a_layer():
    """An unlisted module would escape the layers contract: each new one is placed in pyproject.toml on purpose."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    listed = {name.strip() for contract in config["contracts"] if contract["type"] == "layers"
              for layer in contract["layers"] for name in layer.replace("|", ":").split(":") if name.strip()}
    graph = grimp.build_graph("stoker", cache_dir=None)
    # A package whose children are in different layers (gpu, evaluation) is listed by its children.
    split = {m.rsplit(".", 1)[0] for m in listed if "." in m} - listed
    unplaced = sorted(m for m in graph.modules
                      if m != "stoker" and m not in split and not any(m == p or m.startswith(p + ".") for p in listed))
    assert not unplaced, f"modules in no layer of pyproject.toml's [tool.importlinter]: {', '.join(unplaced)}"


def _cycle(imports: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as the modules along it (first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for imported in sorted(imports[module]):
            if state.get(imported) == 1:
                return path[path.index(imported):] + [imported]
            if imported not in state and (found := visit(imported)):
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(imports):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_no_import_circle():
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    imports = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    circle = _cycle(imports)
    assert circle is None, f"import circle: {' → '.join(circle)}"


def test_the_circle_finder_names_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
