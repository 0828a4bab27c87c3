"""Issue 51 in CI: the OpenAI service and the webhook receiver fuzzed from their schemas with a small fixed-seed
budget (benchmarks/fuzz_surfaces; the longer run is benchmarks/fuzz.py → benchmarks/results/fuzz.json).

The servers are real and their own processes: the tiny Llama on the local tritonserver with the OpenAI service in
front (with the tool-calling template, so ``tools`` reach the model), and ``stoker webhook serve``. Each surface
must answer every generated request without a 5xx it does not document, every error in its own shape, a valid
request answered 200 throughout (a canary client) and after.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.triton, pytest.mark.slow]

pytest.importorskip("pytriton")
pytest.importorskip("hypothesis")
httpx = pytest.importorskip("httpx")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the fuzzers live in benchmarks/

from openai_process import TOOLS_TEMPLATE, tiny_model_served  # noqa: E402
from webhook_process import WEBHOOK_SECRET, webhook_receiver  # noqa: E402

from benchmarks.fuzz_surfaces import Target  # noqa: E402
from benchmarks.fuzz_surfaces import openai as openai_surface  # noqa: E402
from benchmarks.fuzz_surfaces import webhook as webhook_surface  # noqa: E402

SEED = 51
REQUESTS = 80  # a few seconds per surface on 2 cores


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    with tiny_model_served(root / "model", chat_template=TOOLS_TEMPLATE) as (_server, _artifact, base), \
            webhook_receiver(root / "webhook") as (hook, receiver):
        yield Target(openai=base, model="tiny", webhook=hook, webhook_secret=WEBHOOK_SECRET), receiver


def test_the_openai_service_survives_its_fuzzer(target):
    target, _ = target
    tally = openai_surface.run(target, REQUESTS, SEED)
    result = tally.as_json()
    assert tally.generated == REQUESTS and result["responses_5xx"] == 0, result
    assert not tally.failures, tally.failures  # error shape, valid requests answered, canary, the valid one after
    assert tally.by_status["200"] > 0 and tally.by_status["400"] > 0, result  # both sides of the surface reached
    with httpx.Client(base_url=target.openai, timeout=60) as client:
        assert openai_surface.valid_answer(client, target) is None
        # The fault it found: a key gRPC metadata cannot carry was a 500 (tests/unit/test_openai_fuzz_findings.py).
        r = client.post("/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1},
                        headers={"authorization": "Bearer cl\u00e9".encode("latin-1")})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text


def test_the_webhook_receiver_survives_its_fuzzer(target):
    target, receiver = target
    tally = webhook_surface.run(target, REQUESTS, SEED)
    result = tally.as_json()
    assert tally.generated == REQUESTS and not tally.failures, result
    # The one 5xx it documents: a valid signed trigger whose run Prefect cannot start (no API here).
    assert set(s for s in tally.by_status if s.startswith("5")) <= {"503"}, result
    assert tally.by_status["401"] > 0 and tally.by_status["400"] > 0, result
    assert receiver.poll() is None
    with httpx.Client(base_url=target.webhook.removesuffix("/hooks/build"), timeout=30) as client:
        assert webhook_surface.healthy(client) is None
        assert client.post("/hooks/build", content=b"{}").status_code == 401
