"""The container executor for real: Docker + the CPU image (and the in-process mode), no mocks."""

from __future__ import annotations

import os
import signal
import threading
import uuid

import pytest

from stoker.containers.execute import (
    ContainerStep,
    ContainerStepCancelled,
    ContainerStepFailed,
    ContainerStepTimeout,
    DockerExecutor,
    LocalExecutor,
    Mount,
)
from stoker.errors import StepError

DEPLOYMENT = "test-container-exec"
SECRET = "hf_" + "s3cr3t" * 4


@pytest.fixture
def executor(triton_image):
    return DockerExecutor(labels={"ai.stoker.deployment": DEPLOYMENT}, poll_s=0.2)


def sh(image: str, script: str, **kw) -> ContainerStep:
    return ContainerStep(name=f"t-{uuid.uuid4().hex[:8]}", image=image, entrypoint=["/bin/sh", "-c"],
                         argv=[script], **kw)


def leftovers(executor, step: ContainerStep) -> list:
    return executor.client.containers.list(all=True, filters={"label": [f"ai.stoker.step={step.name}",
                                                                        f"ai.stoker.deployment={DEPLOYMENT}"]},
                                           ignore_removed=True)


@pytest.mark.docker
def test_logs_stream_in_order_and_the_container_goes(executor, triton_image, tmp_path):
    (tmp_path / "in.txt").write_text("from the host\n")
    out = tmp_path / "out"
    step = sh(triton_image, "cat /in/in.txt; for i in 1 2 3; do echo line $i; done; echo done > /out/result; "
                            "echo shm $(df -m /dev/shm | tail -1 | awk '{print $2}'); echo nofile $(ulimit -n)",
              mounts=[Mount(str(tmp_path), "/in"), Mount(str(out), "/out", read_only=False)],
              shm_size="64m", ulimits={"nofile": (1024, 1024)}, env={"PUBLIC": "1"})
    lines: list[str] = []
    res = executor.run(step, lines.append)
    assert lines[:4] == ["from the host", "line 1", "line 2", "line 3"]
    assert "shm 64" in lines and "nofile 1024" in lines
    assert res.exit_code == 0 and (out / "result").read_text() == "done\n"
    assert leftovers(executor, step) == []


@pytest.mark.docker
def test_a_failing_step_raises_with_its_last_line_and_is_removed(executor, triton_image, tmp_path):
    # stdout and stderr are separate streams: the pause keeps their order deterministic
    step = sh(triton_image, "echo working; sleep 0.3; echo 'trtllm-build: bad flag' >&2; exit 3")
    with pytest.raises(ContainerStepFailed, match=r"exit 3\): trtllm-build: bad flag$"):
        executor.run(step, lambda _line: None)
    assert leftovers(executor, step) == []
    # read-only mounts stay read-only
    ro = sh(triton_image, "touch /in/x", mounts=[Mount(str(tmp_path), "/in")])
    with pytest.raises(ContainerStepFailed, match="Read-only file system"):
        executor.run(ro, lambda _line: None)
    assert not (tmp_path / "x").exists()


@pytest.mark.docker
def test_secret_env_reaches_the_step_but_never_the_logs(executor, triton_image):
    step = sh(triton_image, f'test ${{#HF_TOKEN}} -eq {len(SECRET)} && echo token ok; echo leaked: $HF_TOKEN',
              secret_env=["HF_TOKEN"])
    lines: list[str] = []
    executor.run(step, lines.append, secrets={"HF_TOKEN": SECRET})
    assert "token ok" in lines and "leaked: ***" in lines
    assert not any(SECRET in line for line in lines)
    assert SECRET not in str(step.to_json())
    with pytest.raises(StepError, match="secret env HF_TOKEN not provided"):
        executor.run(step, lines.append, secrets={})


@pytest.mark.docker
def test_cancel_event_kills_and_removes(executor, triton_image):
    step = sh(triton_image, "echo started; sleep 120")
    cancel = threading.Event()
    threading.Timer(2.0, cancel.set).start()
    with pytest.raises(ContainerStepCancelled):
        executor.run(step, lambda _line: None, cancel=cancel)
    assert leftovers(executor, step) == []


@pytest.mark.docker
def test_keyboard_interrupt_removes_the_container(executor, triton_image):
    step = sh(triton_image, "echo started; sleep 120")
    seen: list[str] = []
    started = threading.Event()

    def on_line(line: str) -> None:
        seen.append(line)
        if line == "started":
            started.set()

    def interrupt() -> None:  # Ctrl-C once the container really runs, however slow the machine is
        if started.wait(120):
            os.kill(os.getpid(), signal.SIGINT)

    # Other tests in the same session (Prefect's engine) may have replaced the SIGINT handler.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            executor.run(step, on_line)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert seen == ["started"]
    assert leftovers(executor, step) == []


@pytest.mark.docker
def test_timeout_kills_and_removes(executor, triton_image):
    step = sh(triton_image, "sleep 120", timeout_s=2)
    with pytest.raises(ContainerStepTimeout, match="ran past 2s"):
        executor.run(step, lambda _line: None)
    assert leftovers(executor, step) == []


def test_in_process_mode_maps_container_paths_to_the_mounts(tmp_path):
    """A worker already inside the image runs the same step as a child process."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("hello\n")
    # Whole arguments and env values that are container paths map back (as the GPU steps pass them).
    step = ContainerStep(name="local", image="any", entrypoint=["/bin/sh", "-c"],
                         argv=[('cat "$1"; echo "$OUT"; echo key=$HF_TOKEN; echo gpus=$CUDA_VISIBLE_DEVICES; '
                                'echo x > "$OUT/made"'), "sh", "/w/in/a.txt"],
                         env={"OUT": "/w/out"}, secret_env=["HF_TOKEN"], gpus=[2, 3],
                         mounts=[Mount(str(tmp_path), "/w", read_only=False)])
    (tmp_path / "out").mkdir()
    lines: list[str] = []
    LocalExecutor().run(step, lines.append, secrets={"HF_TOKEN": SECRET})
    assert lines == ["hello", f"{tmp_path}/out", "key=***", "gpus=2,3"]
    assert (tmp_path / "out" / "made").is_file()
    with pytest.raises(ContainerStepFailed, match=r"exit 4\): boom"):
        LocalExecutor().run(ContainerStep(name="f", image="any", argv=["/bin/sh", "-c", "echo boom; exit 4"]),
                            lambda _l: None)
    with pytest.raises(ContainerStepTimeout):
        LocalExecutor().run(ContainerStep(name="t", image="any", argv=["sleep", "30"], timeout_s=1), lambda _l: None)
