"""Benchmark files: records first, summary JSON + CSV with unit-carrying names, markdown table, PNG plot."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from stoker.bench.metrics import ClientLoad, RequestRecord, client_saturation, summarize
from stoker.bench.output import markdown_table, write_all


def _rec(rid: int, start: float, chunks: tuple[float, ...], osl: int, ok: bool = True) -> RequestRecord:
    return RequestRecord(request_id=rid, concurrency=2, start_s=start, first_response_s=chunks[0] if ok else None,
                         end_s=chunks[-1], chunk_times_s=chunks if ok else (), input_tokens=8,
                         output_tokens=osl if ok else 0, ok=ok, error=None if ok else "boom",
                         requested_output_tokens=4)


RECORDS = [
    _rec(0, 0.0, (0.1, 0.11, 0.13, 0.16), 4),  # inter-chunk gaps 10, 20, 30 ms
    _rec(1, 0.0, (0.2, 0.25), 2),  # short: 2 of 4 asked; gap 50 ms
    _rec(2, 0.1, (0.3,), 0, ok=False),
]


def test_inter_chunk_short_outputs_and_error_kinds() -> None:
    s = summarize(RECORDS, 2)
    assert s.inter_chunk_ms is not None
    assert sorted(round(g * 1000, 6) for r in RECORDS for g in r.inter_chunk_s) == [10.0, 20.0, 30.0, 50.0]
    assert abs(s.inter_chunk_ms.mean - 27.5) < 1e-9 and abs(s.inter_chunk_ms.max - 50.0) < 1e-9
    assert s.short_outputs == 1 and s.error_counts == {"boom": 1}
    assert s.output_tokens is not None and (s.output_tokens.min, s.output_tokens.max) == (2.0, 4.0)


def test_client_saturation_judgement() -> None:
    idle = ClientLoad(workers=1, cpu_percent=20.0, loop_lag_ms_p99=9.0, loop_lag_ms_max=30.0, loop_lag_ms_p90=0.4)
    assert client_saturation(idle) is None  # one stall is not saturation
    busy = ClientLoad(workers=2, cpu_percent=97.0, loop_lag_ms_p99=20.0, loop_lag_ms_max=40.0, loop_lag_ms_p90=8.0,
                      send_lag_ms_p99=25.0)
    assert client_saturation(busy) == ("CPU 97 % of a core, event-loop lag p90 8.0 ms, "
                                       "sends 25.0 ms behind schedule (p99)")
    s = summarize(RECORDS, 2, client=busy)
    assert s.client_saturated and "CPU 97 %" in markdown_table([s.to_dict()])


def test_files_are_written_records_first(tmp_path: Path) -> None:
    levels = [summarize(RECORDS, 2).to_dict(), summarize(RECORDS[:1], 4).to_dict()]
    summary = {"model": "ensemble", "levels": levels, "warnings": []}
    files = write_all(tmp_path, RECORDS, summary, "title")
    assert [f.name for f in files] == ["records.jsonl", "summary.json", "summary.csv", "table.md",
                                       "latency_throughput.png"]
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    assert [json.loads(x)["request_id"] for x in lines] == [0, 1, 2]
    assert json.loads((tmp_path / "summary.json").read_text())["levels"][0]["errors"] == 1
    with open(tmp_path / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["concurrency"] for r in rows] == ["2", "4"]
    for column in ("ttft_ms_p50", "ttft_ms_p99", "itl_ms_p95", "inter_chunk_ms_std", "e2e_ms_min",
                   "output_tokens_per_s", "requests_per_s", "client_cpu_percent"):
        assert column in rows[0]
    assert (tmp_path / "latency_throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (tmp_path / "table.md").read_text()
    assert table.startswith("| level |") and "| concurrency 2 | 3 | 1 |" in table
