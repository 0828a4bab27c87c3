"""The spec's fleet section: what is refused at load, one line each, and the waves and host specs it plans."""

import pytest

from stoker.errors import SpecError
from stoker.serving import fleet, front
from stoker.spec.load import parse_spec

HOSTS = [{"name": "east", "docker_host": "unix:///run/east.sock", "deployment": "serve_host/east"},
         {"name": "west", "docker_host": "unix:///run/west.sock", "deployment": "serve_host/west",
          "ports": {"http": 18000, "grpc": 18001, "metrics": 18002}},
         {"name": "north", "docker_host": "tcp://10.0.0.3:2376", "deployment": "serve_host/north"}]


def spec(shared: bool = True, **fl):
    return {"model": {"repo_id": "org/model"}, "storage": {"bucket": "my-bucket", "shared_cache": shared},
            "fleet": {"hosts": HOSTS, **fl}}


def test_default_waves_are_a_canary_then_the_rest_and_each_host_gets_its_own_one_host_spec():
    s = parse_spec(spec(front={"http": 19000, "grpc": 19001}))
    assert s.fleet.plan() == [["east"], ["west", "north"]]
    west = fleet.host_spec(s, s.fleet.host("west"))
    assert west.fleet is None and west.deploy.docker_host == "unix:///run/west.sock"
    assert (west.deploy.ports.http, west.deploy.ports.grpc, west.deploy.ports.metrics) == (18000, 18001, 18002)
    east = fleet.host_spec(s, s.fleet.host("east"))
    assert east.deploy.ports == s.deploy.ports and east.deploy.name == s.deploy.name
    cfg = front.render(s)
    assert "bind 127.0.0.1:19001 proto h2" in cfg and "server west 127.0.0.1:18001 proto h2 check port 18000 check-proto h1" in cfg
    # A spec without fleet dumps as before (its digest and manifests unchanged).
    assert "fleet" not in parse_spec({"model": {"repo_id": "org/model"}, "storage": {"bucket": "b-1"}}).model_dump()


@pytest.mark.parametrize("data, says", [
    (spec(waves=[["east"], ["west", "south"], ["north"]]), "a wave names unknown host 'south'"),
    (spec(waves=[["east"], ["west"]]), "host 'north' is in no waves"),
    (spec(waves=[["east", "west"], ["west", "north"]]), "host 'west' is in 2 waves"),
    (spec(shared=False), "fleet needs storage.shared_cache: true"),
    ({**spec(), "fleet": {"hosts": [HOSTS[0], {**HOSTS[1], "name": "east"}]}}, "name 'east' names two hosts"),
    ({**spec(), "fleet": {"hosts": [HOSTS[0], {**HOSTS[1], "docker_host": "unix:///run/east.sock"}]}},
     "docker_host 'unix:///run/east.sock' names two hosts"),
    ({**spec(), "fleet": {"hosts": [{**HOSTS[0], "name": "East_1"}]}}, "fleet host 'East_1': use lowercase"),
])
def test_bad_fleets_are_refused_at_load_in_one_line(data, says):
    with pytest.raises(SpecError) as err:
        parse_spec(data)
    assert says in str(err.value) and "\n" not in str(err.value).strip(), str(err.value)


def test_a_halted_fleet_says_which_host_failed_why_and_who_was_switched_back():
    line = fleet.halted("west", 2, "engine gone", ["east"], {})
    assert line == "fleet: host 'west' failed in wave 2: engine gone; switched back: east"
    assert "NOT switched back: east (it served nothing before)" in fleet.halted("west", 2, "x", [],
                                                                                {"east": "it served nothing before"})
