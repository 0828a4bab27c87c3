"""Listing stoker's containers while another process removes one: the removed one is gone, not an error.

The Docker SDK lists ids, then inspects each; a container removed in between (a retire, another deployment's
`stoker down`) made `stoker status` fail with "No such container" in a fresh-clone CI run. Here the removal happens
for real, on the real daemon, at exactly that moment: the first inspection removes the other container first.
"""

from __future__ import annotations

import uuid

import pytest

from stoker.containers import engine

pytestmark = [pytest.mark.docker]


def test_a_container_removed_while_listed_is_left_out(triton_image):
    from stoker.spec.schema import Deploy

    client = engine.connect()
    name = f"list-{uuid.uuid4().hex[:6]}"
    labels = {engine.LABEL_MANAGED: "true", engine.LABEL_DEPLOYMENT: name}
    made = [client.containers.create(Deploy().proxy_image, command=["true"], labels=labels) for _ in range(2)]
    inspect = client.api.inspect_container
    removed: list[str] = []

    def racing(container_id, *args, **kwargs):
        if not removed:  # another process's `stoker down`, between the listing and this inspection
            victim = next(c for c in made if not container_id.startswith(c.id) and c.id != container_id)
            client.api.remove_container(victim.id, force=True)
            removed.append(victim.id)
        return inspect(container_id, *args, **kwargs)

    client.api.inspect_container = racing
    try:
        found = engine.containers(client, name)
    finally:
        client.api.inspect_container = inspect
        for c in made:
            if c.id not in removed:
                client.api.remove_container(c.id, force=True)
    assert len(removed) == 1
    assert [c.id for c in found] == [c.id for c in made if c.id not in removed]
