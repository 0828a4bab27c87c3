"""The suite's cost on a fresh clone, from `.ci/run` logs; writes JSON.

    python3 benchmarks/suite.py LOG [LOG ...] [--fast-s S] [--out benchmarks/results/suite.json]

Each LOG is the whole output of one `CI=true bash .ci/run` on a fresh clone (set-up included, images built by the
run). Read from it: set-up and test seconds (the `ci:` lines; for a log of a run before those lines existed, the
pytest summary and the shell's `real` time), each tier's seconds (`tier NAME: N s`, printed by the Makefile),
tests passed, skipped (with reasons) and failed over both tiers, and the service tier's slowest (pytest
--durations=40). --fast-s records a `make test-fast` measured beside them (same machine kind).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse(text: str) -> dict:
    out: dict = {}
    if m := re.search(r"^ci: set-up (\d+) s$", text, re.M):
        out["setup_s"] = int(m[1])
    if m := re.search(r"^ci: tests (\d+) s; all (\d+) s$", text, re.M):
        out["tests_s"], out["all_s"] = int(m[1]), int(m[2])
    # One pytest summary per tier (`make test` runs the fast tier, then the service tier); counts add up.
    out["tiers_s"] = {name: int(sec) for name, sec in re.findall(r"^tier (\w+): (\d+) s$", text, re.M)}
    summaries = re.findall(r"^=*\s*(.*(?:passed|failed).*) in ([\d.]+)s", text, re.M)
    if summaries:
        out["pytest_s"] = round(sum(float(seconds) for _, seconds in summaries), 2)
        for counts, _ in summaries:
            for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?)", counts):
                out[what] = out.get(what, 0) + int(n)
    out["skip_reasons"] = re.findall(r"^SKIPPED \[\d+\] (.*)$", text, re.M)
    if "all_s" not in out and (m := re.search(r"^real\s+(\d+)m([\d.]+)s", text, re.M)):
        out["all_s"] = round(int(m[1]) * 60 + float(m[2]), 1)
    # The service tier's list (the last one printed: 25 in older logs, 40 now).
    blocks = re.split(r"^=+ slowest \d+ durations =+$", text, flags=re.M)
    block = blocks[-1] if len(blocks) > 2 else ""
    out["slowest"] = [{"s": float(s), "phase": phase, "test": test}
                      for s, phase, test in re.findall(r"^([\d.]+)s (call|setup|teardown)\s+(\S+)", block, re.M)][:40]
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("logs", nargs="+", type=Path)
    ap.add_argument("--fast-s", type=float, default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "suite.json")
    a = ap.parse_args()
    runs = [{"log": p.name, **parse(p.read_text(errors="replace"))} for p in a.logs]
    result = {"what": "CI=true bash .ci/run on a fresh clone, 2-core machine (see benchmarks/suite.py)",
              "target_all_s": 25 * 60, "target_fast_s": 3 * 60, "runs": runs, "make_test_fast_s": a.fast_s}
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    for r in runs:
        print(f"{r['log']}: all {r.get('all_s')} s, tests {r.get('pytest_s')} s, passed {r.get('passed')}, "
              f"skipped {r.get('skipped', 0)}, failed {r.get('failed', 0)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
