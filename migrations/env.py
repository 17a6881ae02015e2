"""Alembic's environment: migrate the database named by the caller against the control plane's
models (``controlplane.db.models.Base.metadata``).

``controlplane.db.migrate`` builds the Alembic config in code and passes the URL in
``config.attributes["url"]``; ``alembic -x url=...`` (with an alembic.ini of your own) works too.
SQLite runs in batch mode (``render_as_batch``: it cannot alter a table in place, so Alembic
rebuilds it) with foreign keys off while migrating, so that a rebuild does not cascade.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from controlplane.db.models import Base
from controlplane.db.session import make_engine, parse_url

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = config.attributes.get("url") or context.get_x_argument(as_dictionary=True).get("url")
    url = url or config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit("no database URL: pass -x url=... or use heteroplane db upgrade")
    return str(url)


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )


def run_migrations_offline() -> None:
    url = parse_url(_url())
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=url.get_backend_name() == "sqlite",
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = make_engine(_url(), foreign_keys=False)
    try:
        with engine.connect() as connection:
            _configure(connection)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
