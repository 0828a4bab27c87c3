"""Shared fixtures: every test gets its own state; integration tests get real local servers."""

from __future__ import annotations

import collections
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# One Prefect home per test process (each xdist worker is one), set before anything imports Prefect: the temporary
# API that in-process flows start keeps its SQLite database there, and two processes must not share one.
_OWN_PREFECT_HOME = None if os.environ.get("STOKER_TEST_KEEP_PREFECT_HOME") else tempfile.mkdtemp(
    prefix="stoker-test-prefect-")
if _OWN_PREFECT_HOME:
    os.environ["PREFECT_HOME"] = _OWN_PREFECT_HOME

# Port leases (stoker/containers/port_lease.py) live in $STOKER_HOME, which is each test's own: every test process
# (each xdist worker, and what its tests start) shares one folder instead, so that their picks never collide.
os.environ.setdefault("STOKER_PORT_LEASES", str(Path(tempfile.gettempdir()) / f"stoker-test-port-leases-{os.getuid()}"))

if _OWN_PREFECT_HOME and os.environ.get("STOKER_PREFECT_DB_TEMPLATE"):  # `make test-services` makes one per machine
    from stoker.stack import prefect_home as _prefect_home

    _prefect_home.seed(Path(_OWN_PREFECT_HOME))


def pytest_unconfigure(config):
    if _OWN_PREFECT_HOME:
        shutil.rmtree(_OWN_PREFECT_HOME, ignore_errors=True)


# Skips a run accepts, each with its reason (one per line: NODE-ID-PREFIX  # reason).
ALLOWED_SKIPS = Path(__file__).with_name("allowed_skips.txt")


def _allowed_skips() -> list[str]:
    lines = ALLOWED_SKIPS.read_text().splitlines() if ALLOWED_SKIPS.exists() else []
    return [line.split("#", 1)[0].strip() for line in lines if line.split("#", 1)[0].strip()]


def pytest_sessionfinish(session, exitstatus):
    """A skip not on allowed_skips.txt fails the run, in both tiers: a test that cannot run here is made to run
    (set-up installs what it needs) or deleted, never passed over in silence."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    allowed = _allowed_skips()
    bad = [r.nodeid for r in skipped if not any(r.nodeid.startswith(a) for a in allowed)]
    if bad:
        reporter.write_line(f"skips: {bad[0].split('::', 1)[0]}: {len(bad)} skip(s) not in tests/{ALLOWED_SKIPS.name} "
                            f"({', '.join(bad[:10])})", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# The longest files of a parallel run (`make test`, 2 cores), longest first: each file's setup + call seconds summed
# from ci74's --durations=40 (test_promotion's many short tests from earlier --durations=0 logs). Largest first keeps
# every process busy to the end: in ci74's order test_flow (~500 s) and test_demo_ui (~350 s) started 9th and 14th.
# test_demo_ui.py is now part of test_flow.py (one cold demo build serves both; measured in that commit).
# test_fleet.py: ~930 s in ci75, where 11th it started late and ran on alone at the end; a name with no file is ignored.
LONGEST_FILES = ("test_operate_rollouts.py", "test_operate_walkthrough.py", "test_fleet.py", "test_standin_pytorch.py",
                 "test_flow.py", "test_promotion.py", "test_standin_tensorrt.py", "test_lora_served.py",
                 "test_build_matrix.py", "test_architectures_served.py", "test_routing.py",
                 "test_schedule_fires.py", "test_quantize.py", "test_operate_triggers.py", "test_matrix_concurrent.py",
                 "test_one_run_per_deployment.py", "test_bad_input.py", "test_openai_deployment.py",
                 "test_prefect_yaml.py", "test_operate_stack.py", "test_s3_faults.py", "test_long_streams.py")


def pytest_collection_modifyitems(config, items):
    from tiers import check_collection, is_fast

    check_collection(items)
    # Files with a slow test first, each file kept whole and in order: the parallel run (`make test`, one file per
    # process at a time) starts its longest files early instead of leaving one of them for last on an idle machine.
    # Longest first: the files measured longest (LONGEST_FILES), then files with a slow test, then by how many
    # tests need services. A wrong guess costs minutes at the end of the run, never a result.
    def file_of(item):
        return item.nodeid.split("::", 1)[0]

    slow_files = {file_of(item) for item in items if item.get_closest_marker("slow")}
    heavy = collections.Counter(file_of(item) for item in items if not is_fast(item))
    measured = {f"tests/integration/{name}": n for n, name in enumerate(LONGEST_FILES)}
    rank = {id(item): (measured.get(file_of(item), len(measured)), file_of(item) not in slow_files,
                       -heavy[file_of(item)], i) for i, item in enumerate(items)}
    items.sort(key=lambda item: rank[id(item)])


@pytest.fixture(autouse=True)
def _tier_guard(request, monkeypatch):
    """A test without a service marker that starts a service or a container errors (tests/tiers.py)."""
    from tiers import guard, is_fast

    if is_fast(request.node):
        guard(request.node, monkeypatch)


@pytest.fixture(autouse=True)
def _isolated_homes(tmp_path, monkeypatch):
    """Fresh STOKER_HOME and HF caches per test, so no test sees another's cache."""
    monkeypatch.setenv("STOKER_HOME", str(tmp_path / "stoker-home"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    # Loaded CI machines can take longer than Prefect's default 20 s to start the ephemeral API.
    monkeypatch.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS",
                       os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180"))


@pytest.fixture(scope="session", autouse=True)
def _prefect_temporary_api_stopped(request):
    """Prefect's temporary API, started by tests that run flows in this process: on a port of its own, away from the
    default ports other tests serve on at the same time (test_operate_walkthrough's), and stopped before pytest
    closes its capture streams; Prefect's own atexit hook would log into them after (stoker/stack/prefect_ephemeral.py)."""
    from tiers import is_fast

    if not all(is_fast(item) for item in request.session.items):  # the fast tier imports no Prefect server
        from stoker.stack.prefect_ephemeral import place_temporary_api

        # Only the port: telemetry_off() would set its variable in this worker's environment, which every `stoker`
        # process a test starts inherits, and then no test would show that stoker turns telemetry off itself.
        place_temporary_api()
    yield
    from stoker.stack.prefect_ephemeral import stop_ephemeral_api

    stop_ephemeral_api()


@pytest.fixture(scope="session")
def worker_prefect_api(_prefect_temporary_api_stopped) -> str:
    """This test process's temporary Prefect API (the one its in-process flows use), for the `stoker` processes a
    test starts: without PREFECT_API_URL each would start one of its own, importing Prefect's server twice (itself
    and the API's process: about 12 CPU-s each on a 2-core CI machine, measured). Tests of the temporary API itself
    (test_flow's cold run, test_quiet_exit, test_s3_faults' frozen upload) keep their own."""
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()  # one per process: Prefect's client finds this same instance
    server.start()
    return server.api_url


@pytest.fixture(scope="session")
def session_state(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("stack")


@pytest.fixture(scope="session")
def s3_server(session_state):
    """The session's S3 (moto) URL, the one local_stack also uses; a test isolates itself by its own bucket."""
    from stoker.stack.s3server import ensure_s3
    from stoker.stack.services import stop_all

    yield ensure_s3(session_state)
    stop_all(session_state)  # also stops what local_stack started there, if it has not already


@pytest.fixture(scope="session")
def local_stack(session_state, s3_server):
    """A real S3 (moto) and Hub mirror (olah) on loopback, with the tiny Llama published; stopped at the end."""
    from stoker.demo import DEMO_REPO, ensure_tiny_model
    from stoker.stack.hub_mirror import ensure_mirror, repos_dir
    from stoker.stack.s3server import s3_env
    from stoker.stack.services import stop_all

    model_log: list[str] = []  # what `stoker demo` prints while it generates the model (test_flow checks it)
    ensure_tiny_model(repos_dir(session_state), log=model_log.append)
    hub = ensure_mirror(session_state)
    s3_url = s3_server
    env = {k: v for k, v in s3_env(s3_url).items() if k != "AWS_ENDPOINT_URL"}
    yield {"hub": hub, "s3": s3_url, "aws_env": env, "repo_id": DEMO_REPO, "repos": repos_dir(session_state),
           "state": session_state, "model_log": model_log}
    stop_all(session_state)


@pytest.fixture(scope="session")
def triton_image(session_state):
    """The CPU Triton image and the proxy image on a running Docker daemon (built here when missing)."""
    from stoker.spec.schema import Deploy
    from stoker.stack.dockerd import ensure_daemon
    from stoker.stack.image import ensure_proxy_image

    ensure_daemon(os.environ.get("DOCKER_HOST"), session_state)
    name = Deploy().image
    ensure_proxy_image(Deploy().proxy_image, None, lambda _l: None, base=name)  # builds the Triton image first
    return name


@pytest.fixture(scope="session")
def standin_image(triton_image):
    """STAND-IN, NOT TensorRT-LLM: the CPU Triton image with stoker's reference model as the backend `tensorrtllm`
    (stoker/stack/standin_image.py; one layer, seconds), for `target: tensorrt` runs with STOKER_STANDIN=1."""
    from stoker.stack.standin_image import ensure_standin_image

    return ensure_standin_image(log=lambda _l: None)
