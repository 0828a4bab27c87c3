"""Every name a module uses is defined: a moved function that lost an import fails here, in the fast tier,
instead of in the one command that reaches it (ruff's pyflakes rules for undefined names)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_module_uses_an_undefined_name():
    ruff = Path(sys.executable).with_name("ruff")
    r = subprocess.run([str(ruff), "check", "--no-cache", "--select", "F821,F822,F823", "--output-format", "concise",
                        "stoker", "tasks", "flows", "tests", "benchmarks", "infra"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.stdout.strip().splitlines() or [r.stderr.strip()])[0]
