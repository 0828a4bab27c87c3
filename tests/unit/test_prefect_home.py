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
    assert [p.name for p in home.iterdir()] == ["prefect.db"]  # no temporary copy left


def test_nothing_is_seeded_without_a_template_or_for_another_database(tmp_path, monkeypatch):
    monkeypatch.delenv(prefect_home.TEMPLATE_ENV, raising=False)
    template = tmp_path / "template.db"
    template.write_bytes(b"migrated")
    assert not prefect_home.seed(tmp_path / "a", {})
    assert not prefect_home.seed(tmp_path / "b", {prefect_home.TEMPLATE_ENV: str(tmp_path / "missing.db")})
    assert not prefect_home.seed(tmp_path / "c", {prefect_home.TEMPLATE_ENV: str(template),
                                                  "PREFECT_API_DATABASE_CONNECTION_URL": "postgresql+asyncpg://x"})
    assert not any((tmp_path / d).exists() for d in "abc")
