"""Not collected on its own (no test_ prefix): test_quiet_exit.py runs it in a pytest subprocess.

A flow run inside the pytest process starts Prefect's temporary API, as test_operate_rollouts.py does.
"""

import pytest
from prefect import flow, get_run_logger

pytestmark = [pytest.mark.prefect]  # the temporary API is a service: unmarked, tests/tiers.py refuses it


@flow
def say_hello() -> str:
    get_run_logger().info("hello from a flow inside pytest")
    return "hello"


def test_a_flow_in_the_pytest_process():
    assert say_hello() == "hello"
