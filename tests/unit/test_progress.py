"""stoker.record.progress: the reporter's cadence, terminal detection, thread safety and artifact updates, and the
child-process progress protocol (issue 14 item 7)."""

from __future__ import annotations

import io
import re
import sys
import threading

import pytest

from stoker.record import progress
from stoker.orchestration.child import run_module
from stoker.errors import ChildProcessFailed
from stoker.record.progress import ChildProgress, Progress, child_line, parse_child_line
from stoker.stack.image import BUILD_SH, BUILD_SH_PHASES, build_sh_phase, docker_build_step


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Sink:
    """Stands in for a Prefect progress artifact: records (percent, description)."""

    def __init__(self) -> None:
        self.updates: list[tuple[float, str]] = []

    def update(self, percent: float, description: str) -> None:
        self.updates.append((percent, description))


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


# ---- cadence without a terminal ------------------------------------------------------------------------


def test_plain_lines_every_ten_percent_never_one_per_chunk():
    lines: list[str] = []
    with Progress("upload", 26_200_000, "B", lines.append, stream=io.StringIO(), artifact=None) as p:
        for _ in range(1000):
            p.advance(26_200)  # 1000 chunks of 0.1 %
    assert lines[:2] == ["upload: 2.6/26.2 MB (10%)", "upload: 5.2/26.2 MB (20%)"]
    assert len(lines) == 10  # 10 %, …, 90 %, and the final line
    assert re.fullmatch(r"upload: 26\.2/26\.2 MB \(100%, \d+\.\d s\)", lines[-1])


def test_slow_work_gets_a_line_every_five_seconds_between_the_ten_percent_steps():
    clock, lines = Clock(), []
    p = Progress("calibration pass 1", 1000, "batch", lines.append, stream=io.StringIO(), artifact=None, clock=clock)
    for _ in range(30):  # 1 batch (0.1 %) a second: 30 s, never 10 %
        clock.t += 1
        p.advance(1)
    assert [line.split(" (")[0] for line in lines] == [f"calibration pass 1: {n}/1000 batches"
                                                       for n in (5, 10, 15, 20, 25, 30)]
    clock.t += 1
    p.close()
    assert lines[-1] == "calibration pass 1: 1000/1000 batches (100%, 31.0 s)"


def test_a_failed_piece_of_work_logs_no_final_line_and_late_callbacks_are_ignored():
    lines, sink = [], Sink()
    with pytest.raises(RuntimeError):
        with Progress("download", 1000, "B", lines.append, stream=io.StringIO(), artifact=sink) as p:
            p.advance(300)
            raise RuntimeError("the hub went away")
    p.advance(700)
    assert lines == ["download: 0.3/1.0 kB (30%)"]
    assert sink.updates[-1] == (30.0, "download: stopped at 0.3/1.0 kB")


def test_lines_false_leaves_the_plain_lines_to_the_work_itself():
    lines: list[str] = []
    with Progress("image x", 4, "step", lines.append, stream=io.StringIO(), artifact=None, lines=False) as p:
        for done in range(4):
            p.update(done, note="docker import")
    assert lines == []


# ---- a terminal gets a bar ----------------------------------------------------------------------------------


def test_a_terminal_gets_a_bar_and_no_lines_and_log_lines_are_written_around_it():
    term, lines = Terminal(), []
    with Progress("upload", 1_000_000, "B", lines.append, stream=term, artifact=None) as p:
        say = p.printer(lambda line: term.write(line + "\n"))
        p.advance(500_000)
        say("a log line while the bar is up")
    out = term.getvalue()
    assert lines == []
    assert "upload:" in out and "100%" in out and "\r" in out  # tqdm redraws in place
    assert "a log line while the bar is up\n" in out


def test_tty_detection_follows_the_stream_unless_told():
    assert Progress("x", 1, stream=Terminal(), artifact=None)._bar is not None
    assert Progress("x", 1, stream=io.StringIO(), artifact=None)._bar is None
    assert Progress("x", 1, stream=Terminal(), artifact=None, tty=False)._bar is None
    closed = io.StringIO()
    closed.close()
    assert Progress("x", 1, stream=closed, artifact=None)._bar is None


# ---- threads ----------------------------------------------------------------------------------------------


def test_many_threads_report_into_one_reporter_exactly():
    lines, sink = [], Sink()
    clock = Clock()
    p = Progress("upload", 8 * 5000, "B", lines.append, stream=io.StringIO(), artifact=sink, clock=clock)

    def send(share):
        for _ in range(5000):
            share(1)
            clock.t += 0.00001  # racy on purpose: the clock only decides when to emit (0.4 s in all)
        share.complete()

    threads = [threading.Thread(target=send, args=(p.share(5000),)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert p.done == 8 * 5000
    p.close()
    percents = [int(re.search(r"\((\d+)%", line).group(1)) for line in lines]
    assert percents == sorted(percents) and len(lines) <= 10 and percents[-1] == 100
    assert [u[0] for u in sink.updates] == sorted(u[0] for u in sink.updates) and sink.updates[-1][0] == 100.0


def test_a_share_never_counts_more_than_its_size_and_counts_back_on_a_retry():
    p = Progress("upload", 100, "B", lambda _l: None, stream=io.StringIO(), artifact=None)
    share = p.share(60)
    share(50)
    share(-20)  # s3transfer rewinds a part it sends again
    assert p.done == 30
    share(500)
    assert p.done == 60
    share(-500)
    assert p.done == 0
    share.complete()
    share.complete()
    assert p.done == 60


# ---- the artifact -----------------------------------------------------------------------------------------


def test_the_artifact_is_updated_at_most_once_a_second_and_at_the_end():
    clock, sink = Clock(), Sink()
    p = Progress("upload", 100, "B", lambda _l: None, stream=io.StringIO(), artifact=sink, clock=clock)
    for _ in range(9):
        clock.t += 0.3
        p.advance(10)
    p.close()
    assert [u[0] for u in sink.updates] == [40.0, 80.0, 100.0]  # at 1.2 s and 2.4 s, then the end
    assert sink.updates[-1][1].startswith("upload: 100.0/100.0 B (100%")


def test_outside_a_prefect_run_there_is_no_artifact(monkeypatch):
    assert not progress.in_prefect_run()
    assert Progress("x", 1, stream=io.StringIO())._artifact is None


def test_an_artifact_that_fails_never_fails_the_work():
    class Broken:
        def update(self, percent, description):
            raise ConnectionError("the API is gone")

    lines: list[str] = []
    with Progress("upload", 10, "B", lines.append, stream=io.StringIO(), artifact=Broken()) as p:
        p.advance(5)
    assert lines[0] == "upload: 5.0/10.0 B (50%)" and p._artifact is None


# ---- the child protocol -------------------------------------------------------------------------------------


def test_child_lines_round_trip_and_anything_else_is_not_progress():
    out = io.StringIO()
    child_line("calibration pass 2", 3, 4, "batch", file=out)
    line = out.getvalue().rstrip("\n")
    assert line == 'stoker-progress {"label": "calibration pass 2", "done": 3, "total": 4, "unit": "batch"}'
    assert parse_child_line(line) == {"label": "calibration pass 2", "done": 3.0, "total": 4.0, "unit": "batch"}
    for other in ("quantize: loaded", "stoker-progress {not json", 'stoker-progress {"label": "x"}',
                  'stoker-progress {"label": "x", "done": "NaN", "total": 4}', 'stoker-progress [1, 2]'):
        assert parse_child_line(other) is None


def test_child_progress_opens_one_reporter_per_label_and_ends_it_at_its_total():
    lines: list[str] = []
    kids = ChildProgress(lines.append, stream=io.StringIO(), artifact=None)
    for label in ("calibration pass 1", "calibration pass 2"):
        for done in range(5):
            assert kids.feed(f'stoker-progress {{"label": "{label}", "done": {done}, "total": 4, "unit": "batch"}}')
        assert lines[-1].startswith(f"{label}: 4/4 batches (100%, ")  # said at once, not at the next line
    assert not kids.feed("quantize: export took 1.0s")
    kids.close()
    assert [line.split(" (")[0] for line in lines] == [
        "calibration pass 1: 1/4 batches", "calibration pass 1: 2/4 batches", "calibration pass 1: 3/4 batches",
        "calibration pass 1: 4/4 batches",
        "calibration pass 2: 1/4 batches", "calibration pass 2: 2/4 batches", "calibration pass 2: 3/4 batches",
        "calibration pass 2: 4/4 batches"]


WORKER = """
import json, sys
from stoker.record.progress import child_line
print("loading", file=sys.stderr)
for done in range(5):
    child_line("calibration pass 1", done, 4, "batch")
if "--fail" in sys.argv:
    print("error: calibration broke", file=sys.stderr)
    sys.exit(1)
print(json.dumps({"out": "/x"}))
"""


@pytest.fixture
def progress_worker(tmp_path, monkeypatch):
    (tmp_path / "stoker_progress_worker.py").write_text(WORKER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("STOKER_HEAVY_PYTHON", sys.executable)
    return "stoker_progress_worker"


def test_run_module_turns_progress_lines_into_progress_and_keeps_the_result(progress_worker):
    lines: list[str] = []
    assert run_module(progress_worker, [], lines.append) == {"out": "/x"}
    assert lines[0] == "loading"
    assert [line.split(" (")[0] for line in lines[1:]] == [f"calibration pass 1: {n}/4 batches" for n in (1, 2, 3, 4)]
    assert not any("stoker-progress" in line for line in lines)


def test_a_failing_child_names_its_cause_not_a_progress_line(progress_worker):
    lines: list[str] = []
    with pytest.raises(ChildProcessFailed, match="error: calibration broke"):
        run_module(progress_worker, ["--fail"], lines.append)
    assert lines[-1] == "error: calibration broke" and not any("stoker-progress" in line for line in lines)


# ---- image builds -------------------------------------------------------------------------------------------


def test_build_sh_phases_are_the_step_lines_build_sh_prints_in_that_order():
    script = BUILD_SH.read_text()
    positions = [script.find(f'step "{phase}') for phase in BUILD_SH_PHASES]
    assert -1 not in positions and positions == sorted(positions)
    assert build_sh_phase("[build   41s] chroot: venv + Python packages") == (1, "chroot")
    assert build_sh_phase("[build    0s] base rootfs: reusing /c/rootfs.tar") == (0, "base rootfs")
    assert build_sh_phase("[build  170s] done: stoker/triton-cpu:2.51.0-cpu sha256:ab (546 MB)") == (4, "done")
    assert build_sh_phase("[build    0s] pip index: the default of pip") is None
    assert build_sh_phase("    debootstrap: Retrieving Release") is None


def test_docker_build_step_lines():
    assert docker_build_step("Step 3/9 : RUN test -n x") == (3, 9)
    assert docker_build_step("Step 10/12 : ENTRYPOINT [\"haproxy\"]") == (10, 12)
    assert docker_build_step("Successfully built 1234") is None


# ---- downloads ----------------------------------------------------------------------------------------------


def test_snapshot_downloads_bytes_written_bar_feeds_the_download_progress():
    import inspect

    import huggingface_hub._snapshot_download as snapshot

    from stoker.storage.hub import _bars_into

    # huggingface_hub 2.4 (pinned) names its three bars so; every file's bytes go to the "Reconstructing" one.
    source = inspect.getsource(snapshot.snapshot_download)
    assert 'desc="Reconstructing (incomplete total...)"' in source and 'desc="Downloading bytes"' in source
    p = Progress("download", 1000, "B", lambda _l: None, stream=io.StringIO(), artifact=None)
    bar = _bars_into(p)
    written = bar(desc="Reconstructing (incomplete total...)", total=0, initial=0, unit="B", unit_scale=True)
    network = bar(desc="Downloading bytes", total=0, initial=0, unit="B", unit_scale=True)
    files = bar(desc="Fetching 3 files", total=3)
    written.total = 1000  # what huggingface_hub does as each file starts
    written.update(600)
    written.update(-100)  # a resumed download that had to start over
    network.update(600)
    files.update(1)
    assert p.done == 500


class Recorded(Progress):
    """Progress that keeps what it was told (the image builds create theirs inside)."""

    made: list[Recorded] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "stream": io.StringIO(), "artifact": None})
        self.seen: list[float] = []
        self.ended: bool | None = None
        Recorded.made.append(self)

    def update(self, done, note=None):
        self.seen.append(done)
        super().update(done, note)

    def close(self, ok=True):
        self.ended = ok if self.ended is None else self.ended
        super().close(ok)


@pytest.fixture
def recorded(monkeypatch):
    from stoker.stack import image

    Recorded.made = []
    monkeypatch.setattr(image, "Progress", Recorded)
    return Recorded.made


def test_the_triton_image_build_counts_build_sh_phases(tmp_path, monkeypatch, recorded):
    from stoker.stack import image

    fake = tmp_path / "build.sh"
    fake.write_text("#!/bin/sh\n" + "".join(
        f"echo '[build {i:4d}s] {what}'\necho '    detail'\n" for i, what in enumerate(
            ["building x (recipe 1)", "base rootfs: reusing /c/r.tar", "chroot: venv + Python packages",
             "pip index: default", "docker import", "smoke test: python-backend model", "done: x sha256:1 (5 MB)"])))
    fake.chmod(0o755)
    monkeypatch.setattr(image, "BUILD_SH", fake)
    lines: list[str] = []
    image._run_build("x", None, lines.append)
    [steps] = recorded
    assert (steps.total, steps.seen, steps.ended) == (4, [0, 1, 2, 3, 4], True)
    assert len(lines) == 14 and not any("%" in line for line in lines)  # build.sh's own lines, nothing added


def test_the_proxy_image_build_counts_docker_steps_and_a_failed_step_ends_it(recorded):
    from stoker.stack import image

    class Api:
        def __init__(self, chunks):
            self.chunks = chunks

        def build(self, **_kwargs):
            yield from self.chunks

    class Client:
        def __init__(self, chunks):
            self.api = Api(chunks)

    steps = [{"stream": f"Step {i}/3 : RUN step {i}\n"} for i in (1, 2, 3)]
    image._docker_build(Client([*steps, {"stream": " ---> abc\n"}]), "p:1", {}, {}, lambda _l: None)
    image_steps = recorded.pop()
    assert (image_steps.total, image_steps.seen, image_steps.ended, image_steps.done) == (3, [0, 1, 2], True, 3)
    with pytest.raises(image.ImageBuildFailed):
        image._docker_build(Client([steps[0], {"error": "boom"}]), "p:1", {}, {}, lambda _l: None)
    assert recorded.pop().ended is False
