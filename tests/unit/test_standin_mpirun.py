"""The stand-in image's mpirun (infra/standin/mpirun.py): what it accepts of Open MPI's command line, what it
refuses, the rank environment, and the job's end (real child processes, no MPI)."""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stoker.containers.ports import Ports
from stoker.gpu import trtllm
from stoker.spec.load import parse_spec

SCRIPT = Path(__file__).resolve().parents[2] / "infra" / "standin" / "mpirun.py"
_spec = importlib.util.spec_from_file_location("standin_mpirun", SCRIPT)
mpirun = importlib.util.module_from_spec(_spec)
sys.modules["standin_mpirun"] = mpirun  # its dataclasses look their module up
_spec.loader.exec_module(mpirun)


def test_the_products_tp2_command_parses_into_two_single_process_contexts():
    from stoker.demo import DEMO_SPEC
    import yaml

    data = yaml.safe_load(DEMO_SPEC.read_text())
    data.pop("adapters")
    data.update(target="tensorrt", gpus={"type": "h100-80gb", "count": 2}, parallel={"tensor": 2})
    data["deploy"]["image"] = "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"
    argv = trtllm.serve_command(parse_spec(data), Ports(http=8000, grpc=8001, metrics=8002), ["--x=1"], True)
    assert argv[0] == "mpirun"
    job = mpirun.parse(argv[1:])
    assert job.allow_run_as_root and job.size == 2
    (r0, a0), (r1, a1) = job.ranks()
    assert (r0, r1) == (0, 1) and a0[0] == a1[0] == "tritonserver"
    assert "--load-model=tensorrt_llm" in a1 and "--load-model=tensorrt_llm" not in a0
    assert a0[-1].endswith("prefix0_") and a1[-1].endswith("prefix1_")


def test_ranks_are_numbered_across_contexts_in_order_and_program_arguments_are_the_programs():
    job = mpirun.parse(["-np", "2", "a", "-n", "9", ":", "--n", "1", "b", "--allow-run-as-root"])
    assert not job.allow_run_as_root  # after the program: b's own argument
    assert job.ranks() == [(0, ("a", "-n", "9")), (1, ("a", "-n", "9")), (2, ("b", "--allow-run-as-root"))]


@pytest.mark.parametrize("argv, message", [
    (["--host", "a,b", "-n", "1", "x"], "option '--host' is not modelled"),
    (["-n", "1", "--bind-to", "none", "x"], "option '--bind-to' is not modelled"),
    (["--oversubscribe", "-n", "1", "x"], "option '--oversubscribe' is not modelled"),
    (["x"], "app context 1: give -n N"),
    (["-n", "0", "x"], "app context 1: -n needs a positive number"),
    (["-n", "two", "x"], "app context 1: -n needs a positive number"),
    (["-n", "1", "-n", "2", "x"], "the number of processes is given twice"),
    (["-n", "1", "x", ":"], "app context 2 names no program"),
    (["-n", "1"], "app context 1 names no program"),
    ([], "app context 1 names no program"),
])
def test_what_it_does_not_model_is_refused_in_one_line(argv, message, capsys):
    with pytest.raises(mpirun.UsageError, match=message):
        mpirun.parse(argv)
    assert mpirun.main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_rank_environment():
    env = mpirun.rank_env({"KEEP": "1"}, 1, 2)
    assert env == {"KEEP": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1",
                   "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}


def _run(*argv: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(SCRIPT), "--allow-run-as-root", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_each_rank_is_its_own_process_with_its_rank():
    p = _run("-n", "1", "sh", "-c", "echo $OMPI_COMM_WORLD_RANK/$OMPI_COMM_WORLD_SIZE $$", ":",
             "-n", "1", "sh", "-c", "echo $OMPI_COMM_WORLD_RANK/$OMPI_COMM_WORLD_SIZE $$")
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 0
    lines = sorted(out.split("\n")[:2])
    assert [line.split()[0] for line in lines] == ["0/2", "1/2"]
    assert lines[0].split()[1] != lines[1].split()[1]  # two pids


def test_a_failed_rank_terminates_the_others_and_the_job_exits_with_its_status():
    start = time.monotonic()
    p = _run("-n", "1", "sleep", "60", ":", "-n", "1", "sh", "-c", "exit 3")
    _, err = p.communicate(timeout=30)
    assert p.returncode == 3 and time.monotonic() - start < 10  # rank 0's sleep did not run out
    assert "rank 1 (pid " in err and "exited with status 3; terminating the job" in err


def test_sigterm_is_forwarded_to_every_rank():
    p = _run("-n", "2", "sleep", "60")
    time.sleep(1)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 128 + signal.SIGTERM and "received SIGTERM" in err


def test_a_program_that_cannot_start_fails_the_job():
    p = _run("-n", "1", "sleep", "60", ":", "-n", "1", "/nonexistent/program")
    _, err = p.communicate(timeout=30)
    assert p.returncode == 1 and "rank 1: cannot start '/nonexistent/program'" in err


def test_root_needs_allow_run_as_root(monkeypatch, capsys):
    monkeypatch.setattr(mpirun.os, "geteuid", lambda: 0)
    assert mpirun.main(["-n", "1", "true"]) == 1
    assert "running as root needs --allow-run-as-root" in capsys.readouterr().err
