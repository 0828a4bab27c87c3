"""A Triton start that dies of the python backend's IPC abort starts again, from the host (local_triton.start,
judged from this attempt's log only) and in a container (promote's candidate staging); a real load error does not."""

from __future__ import annotations

from stoker.serving.promote import retry_reason
from stoker.stack.local_triton import _ipc_abort

ABORT = b"terminate called after throwing an instance of 'boost::interprocess::lock_exception'\n"
LOAD_ERROR = b"E1127 failed to load 'tensorrt_llm': bad weights\n"


def test_only_this_attempts_log_counts(tmp_path):
    log = tmp_path / "tritonserver.log"
    log.write_bytes(b"I1127 loading: tensorrt_llm:1\n" + ABORT)
    assert _ipc_abort(log, 0)
    earlier = log.stat().st_size
    assert not _ipc_abort(log, earlier)  # an earlier attempt's abort is not this one's
    log.write_bytes(log.read_bytes() + LOAD_ERROR)
    assert not _ipc_abort(log, earlier)  # a real load error is raised, not retried


def test_a_candidate_is_started_again_after_the_abort_or_a_lost_port_only():
    abort = retry_reason(("I1127 TRITONBACKEND_ModelInstanceInitialize: tensorrt_llm_0_0\n" + ABORT.decode()))
    assert abort is not None and "boost::interprocess::lock_exception" in abort
    port = retry_reason("E1127 failed to start HTTP service: Address already in use\n")
    assert port is not None and "port" in port
    assert retry_reason(LOAD_ERROR.decode()) is None
    assert retry_reason("") is None


# The tail of the candidate that stalled in the project's CI (engine.log_tail drops the tables themselves).
STALLED = """I1128 16:06:04.873575 7 model_lifecycle.cc:472] "loading: ensemble:1"
I1128 16:06:06.337041 7 python_be.cc:2249] "TRITONBACKEND_ModelInstanceInitialize: ensemble_0_1 (CPU device 0)"
I1128 16:06:06.579748 7 model_lifecycle.cc:839] "successfully loaded 'ensemble'"
I1128 16:06:06.579877 7 server.cc:604] 
I1128 16:06:06.580228 7 server.cc:631] 
I1128 16:06:06.580289 7 server.cc:674]
"""


def test_a_server_that_loaded_everything_and_then_stalled_is_started_again_only_while_it_runs():
    assert "stalled" in retry_reason(STALLED, running=True)
    assert retry_reason(STALLED, running=False) is None  # it exited: its own failure, with its own log
    started = STALLED + 'I1128 16:06:06.6 7 grpc_server.cc:2558] "Started GRPCInferenceService at 127.0.0.1:8001"\n'
    assert retry_reason(started, running=True) is None  # it opened a port: not ready is something else
    loading = STALLED.split("I1128 16:06:06.579748")[0]
    assert retry_reason(loading, running=True) is None  # still loading a model: slow, not stalled
