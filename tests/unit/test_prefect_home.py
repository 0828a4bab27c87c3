"""Seeding a new Prefect home with a migrated database: only a home without one, only Prefect's own SQLite."""

from __future__ import annotations

from stoker.stack import prefect_home


def test_a_new_home_gets_the_template_and_an_existing_database_is_never_replaced(tmp_path):
    template = tmp_path / "template.db"
    template.write_bytes(b"migrated")
    env = {prefect_home.TEMPLATE_ENV: str(template)}
    home = tmp_path / "home"
    assert prefect_home.seed(home, env)
    assert (home / "prefect.db").read_bytes() == b"migrated"
    (home / "prefect.db").write_bytes(b"runs of its own")
    assert not prefect_home.seed(home, env)
    assert (home / "prefect.db").read_bytes() == b"runs of its own"
    assert sorted(p.name for p in home.iterdir()) == [".stoker-seeded", "prefect.db"]  # no temporary copy left


def test_servers_on_a_seeded_home_skip_block_registration_and_others_register(tmp_path):
    """The template's database has its block types; a home Prefect migrated itself must register them, even when
    the environment it inherited said to skip."""
    template = tmp_path / "template.db"
    template.write_bytes(b"migrated")
    seeded_env = {prefect_home.TEMPLATE_ENV: str(template)}
    prefect_home.seed(tmp_path / "seeded", seeded_env)
    assert seeded_env["PREFECT_API_BLOCKS_REGISTER_ON_START"] == "false"
    assert seeded_env["PREFECT_MEMOIZE_BLOCK_AUTO_REGISTRATION"] == "false"
    assert prefect_home.seed(tmp_path / "seeded", seeded_env) is False  # seeded before: still skips
    assert seeded_env["PREFECT_API_BLOCKS_REGISTER_ON_START"] == "false"

    own = tmp_path / "own"
    own.mkdir()
    (own / "prefect.db").write_bytes(b"migrated by Prefect itself")
    inherited = {**seeded_env}  # a child of a process on a seeded home
    assert prefect_home.seed(own, inherited) is False
    assert inherited["PREFECT_API_BLOCKS_REGISTER_ON_START"] == "true"
    assert inherited["PREFECT_MEMOIZE_BLOCK_AUTO_REGISTRATION"] == "true"


def test_nothing_is_seeded_without_a_template_or_for_another_database(tmp_path, monkeypatch):
    monkeypatch.delenv(prefect_home.TEMPLATE_ENV, raising=False)
    template = tmp_path / "template.db"
    template.write_bytes(b"migrated")
    assert not prefect_home.seed(tmp_path / "a", {})
    assert not prefect_home.seed(tmp_path / "b", {prefect_home.TEMPLATE_ENV: str(tmp_path / "missing.db")})
    assert not prefect_home.seed(tmp_path / "c", {prefect_home.TEMPLATE_ENV: str(template),
                                                  "PREFECT_API_DATABASE_CONNECTION_URL": "postgresql+asyncpg://x"})
    assert not any((tmp_path / d).exists() for d in "abc")


def test_a_server_on_another_database_registers_block_types_whatever_it_inherited(tmp_path, monkeypatch):
    template = tmp_path / "template.db"
    template.write_bytes(b"migrated")
    monkeypatch.setenv("PREFECT_API_BLOCKS_REGISTER_ON_START", "false")  # as a process on a seeded home has
    env = {prefect_home.TEMPLATE_ENV: str(template), "PREFECT_API_DATABASE_CONNECTION_URL": "postgresql+asyncpg://x"}
    assert prefect_home.seed(tmp_path / "pg", env) is False
    assert env["PREFECT_API_BLOCKS_REGISTER_ON_START"] == "true"


def test_a_cold_environment_drops_the_template_and_the_registration_settings_it_inherited(tmp_path, monkeypatch):
    # A cold machine: this process has no template either (seed falls back to it; a developer's shell may export it).
    monkeypatch.delenv(prefect_home.TEMPLATE_ENV, raising=False)
    template = tmp_path / "template.db"
    template.write_bytes(b"migrated")
    env = {prefect_home.TEMPLATE_ENV: str(template), "PATH": "/usr/bin"}
    prefect_home.seed(tmp_path / "seeded", env)
    cold = prefect_home.cold_env(env)
    assert cold == {"PATH": "/usr/bin"}
    assert prefect_home.seed(tmp_path / "cold", cold) is False and cold == {"PATH": "/usr/bin"}
