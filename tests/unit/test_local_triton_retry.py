"""local_triton.start starts again after the python backend's IPC abort, judged from this attempt's log only."""

from __future__ import annotations

from stoker.stack.local_triton import _ipc_abort

ABORT = b"terminate called after throwing an instance of 'boost::interprocess::lock_exception'\n"


def test_only_this_attempts_log_counts(tmp_path):
    log = tmp_path / "tritonserver.log"
    log.write_bytes(b"I1127 loading: tensorrt_llm:1\n" + ABORT)
    assert _ipc_abort(log, 0)
    earlier = log.stat().st_size
    assert not _ipc_abort(log, earlier)  # an earlier attempt's abort is not this one's
    log.write_bytes(log.read_bytes() + b"E1127 failed to load 'tensorrt_llm': bad weights\n")
    assert not _ipc_abort(log, earlier)  # a real load error is raised, not retried
