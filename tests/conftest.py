"""Where the shared measured data lives: ``../shared`` beside the checkout, or
$HETEROPLANE_SHARED; the demo family, trained once for the whole run."""

from __future__ import annotations

import fcntl
import os
import sqlite3
import tempfile
from pathlib import Path

import pytest

SHARED = Path(os.environ.get("HETEROPLANE_SHARED", Path(__file__).resolve().parents[2] / "shared"))
KAIROS_CSV = SHARED / "data" / "kairos_latency_samples.csv.gz"

needs_shared = pytest.mark.skipif(
    not KAIROS_CSV.exists(), reason=f"the shared data is not at {SHARED} (set HETEROPLANE_SHARED)"
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The ``slow`` tests first (stable otherwise): on two processes (``make test``, a file per
    process) their files then start at once and the rest of the suite runs beside them, rather
    than a minutes-long test starting last and running alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def trained_family(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache directory holding the trained demo family (its state dicts and the arrays the
    worker agents serve) and its validation records, made by the function the worker agent's
    loader falls back on (``ensure_family``; about 10 s of a core). Trained
    once for the whole run: the test processes of one ``pytest -n`` run share the folder above
    their own temporary folders, and a lock on a file there makes the first train it while the
    others wait, then find it fresh (``ensure_family`` checks the cached files against their
    manifest). The family's TorchScript archives (what the demo pushes to its registry) are
    written under the lock too: an archive is not byte-for-byte reproducible, and two processes
    exporting it at once would leave each a different one."""
    pytest.importorskip("torch")
    from provisioners.worker.family import MODEL_NAMES, ensure_family, export_torchscript

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each process's own
    with (root / "family.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            directory = ensure_family(root / "family" / "models")
            for name in MODEL_NAMES:
                export_torchscript(name, directory)
            return directory
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# Files whose tests are about the migrations themselves (and the command that runs them): their
# upgrades always run.
_MIGRATING_FILES = ("test_migrations.py", "test_cli_db_token.py")
_TEMPLATE: list[Path] = []  # the migrated file of this process, once made


@pytest.fixture(autouse=True)
def _migrated_once(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new SQLite file migrated to the newest revision in this test process is a copy of the
    first one Alembic migrated here (made by ``migrate.upgrade`` itself, once per process): the
    tests create some hundreds of stores, and Alembic loads and runs every migration script each
    time (about 0.2 s of a core a store, half of the API tests' time). Any other upgrade
    (another revision, a file that exists, PostgreSQL, an engine) runs as written, and so does
    every upgrade in the files about migrations and in the service processes the tests start."""
    if request.path.name in _MIGRATING_FILES:
        return
    from controlplane.db import migrate

    upgrade = migrate.upgrade

    def copying(target: migrate.Target, revision: str = "head") -> None:
        path = _new_sqlite_file(target) if revision == "head" else None
        if path is None:
            upgrade(target, revision)
            return
        if not _TEMPLATE:
            made = Path(tempfile.mkdtemp(prefix="heteroplane-migrated-")) / "head.db"
            upgrade(f"sqlite:///{made}")
            _TEMPLATE.append(made)
        template = _TEMPLATE[0]
        path.parent.mkdir(parents=True, exist_ok=True)
        source, copy = sqlite3.connect(template), sqlite3.connect(path)
        try:
            source.backup(copy)
        finally:
            source.close()
            copy.close()

    monkeypatch.setattr(migrate, "upgrade", copying)


def _new_sqlite_file(target: object) -> Path | None:
    """The file of a SQLite URL (a string or a URL) that does not exist yet; else None."""
    from sqlalchemy.engine import URL, make_url

    if not isinstance(target, str | URL):
        return None
    url = make_url(target)
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        return None
    path = Path(str(url.database))
    return None if path.exists() else path
