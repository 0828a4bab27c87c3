"""A `deploy.listen` address this host lacks is refused at preflight in one line (issue 49): before, the new proxy
failed to bind only after reconcile had removed the running one."""

from __future__ import annotations

from stoker.containers.ports import address_missing


def test_an_address_the_host_lacks_is_named_with_the_systems_reason():
    assert address_missing("127.0.0.1") is None and address_missing("0.0.0.0") is None
    why = address_missing("203.0.113.7")  # TEST-NET-3: never an address of this host
    assert why is not None and why.startswith("this host cannot listen on 203.0.113.7 (")
    assert "\n" not in why
