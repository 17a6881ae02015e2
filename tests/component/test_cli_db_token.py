"""``heteroplane db`` and ``heteroplane token`` against a SQLite file named by the environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.cli import main
from controlplane.db import migrate
from controlplane.db.lease import lock_sqlite_database, schema_change_lock, sqlite_leader_lock
from controlplane.db.store import Store
from controlplane.errors import DatabaseError, DatabaseInUseError

HETEROPLANE = Path(sys.executable).with_name("heteroplane")


@pytest.fixture
def database_url(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    for name in list(os.environ):
        if name.startswith("HETEROPLANE_"):
            monkeypatch.delenv(name)
    url = f"sqlite:///{tmp_path / 'state' / 'heteroplane.db'}"
    monkeypatch.setenv("HETEROPLANE_DATABASE_URL", url)
    return url


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, object]:
    assert main([*args, "--json"]) == 0
    data: dict[str, object] = json.loads(capsys.readouterr().out)
    return data


# The newest migration in the repository: its file name starts with its revision.
NEWEST = max(
    p.name.split("_", 1)[0]
    for p in (Path(__file__).resolve().parents[2] / "migrations" / "versions").glob("0*.py")
)


def test_db_upgrade_current_downgrade(
    database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_json(capsys, "db", "current")["revision"] is None
    upgraded = run_json(capsys, "db", "upgrade")
    assert upgraded["revision"] == upgraded["head"] == NEWEST
    assert upgraded["previous_revision"] is None and upgraded["up_to_date"] is True
    assert main(["db", "current"]) == 0
    assert f"is at revision {NEWEST} (the newest)" in capsys.readouterr().out
    downgraded = run_json(capsys, "db", "downgrade", "--revision", "base")
    assert downgraded["revision"] is None and downgraded["previous_revision"] == NEWEST


def test_an_upgrade_to_an_older_revision_is_refused(
    database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Alembic's upgrade only goes forward: to an older revision it did nothing, and the command
    said where the database was with exit status 0, as if it had moved it."""
    older = sorted(p for p in migrate_revisions() if p < NEWEST)
    run_json(capsys, "db", "upgrade", "--revision", older[-1])
    for target in (older[-2], "base"):
        err = one_line_refusal(capsys, "db", "upgrade", "--revision", target)
        assert err == (
            f"heteroplane db: cannot upgrade {database_url} to {target}: it is at {older[-1]},"
            f" which is newer; to go back: heteroplane db downgrade --revision {target}\n"
        )
    assert run_json(capsys, "db", "current")["revision"] == older[-1]
    # The same revision, or a newer one, is an upgrade as before.
    assert run_json(capsys, "db", "upgrade", "--revision", older[-1])["revision"] == older[-1]
    assert run_json(capsys, "db", "upgrade")["revision"] == NEWEST


def test_an_upgrade_of_a_database_at_an_unknown_revision_is_one_line(
    database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A newer heteroplane migrated it: the revision it is at is not in this history."""
    import sqlite3

    run_json(capsys, "db", "upgrade")
    with sqlite3.connect(database_url.removeprefix("sqlite:///")) as connection:
        connection.execute("UPDATE alembic_version SET version_num = '0999'")
    # It said only "Can't locate revision identified by '0999'".
    for argv in (
        ["db", "upgrade"],
        ["db", "upgrade", "--revision", "0001"],
        ["db", "downgrade", "--revision", "0001"],
    ):
        err = one_line_refusal(capsys, *argv)
        assert "at revision 0999, which this heteroplane does not know" in err, err
        assert "a newer heteroplane migrated it" in err


def migrate_revisions() -> list[str]:
    return [
        p.name.split("_", 1)[0]
        for p in (Path(__file__).resolve().parents[2] / "migrations" / "versions").glob("0*.py")
    ]


def test_db_errors_are_one_line(database_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["db", "upgrade", "--revision", "nope"])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Can't locate revision identified by 'nope'" in err
    with pytest.raises(SystemExit):
        main(["db", "downgrade"])
    assert "--revision" in capsys.readouterr().err


def one_line_refusal(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as caught:
        main(list(argv))
    assert caught.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    return captured.err


@pytest.mark.parametrize("held", ["serving", "leader"])
def test_no_schema_change_while_a_service_runs_on_the_file(
    database_url: str, capsys: pytest.CaptureFixture[str], held: str
) -> None:
    """``db downgrade --revision base`` on the file of a live ``heteroplane serve`` dropped every
    table under it. While a serving process (``<db>.lock``) or a loops process (the leader
    lease's ``<db>.leader.lock``) holds its lock, a downgrade, and an upgrade with something to
    do, are refused in one line and the database is left as it was."""
    previous = f"{int(NEWEST) - 1:04d}"
    run_json(capsys, "db", "upgrade", "--revision", previous)
    if held == "serving":
        service = lock_sqlite_database(database_url)
        assert service is not None
        release = service.close
    else:
        loops = sqlite_leader_lock(database_url)
        assert loops is not None and loops.try_acquire()
        release = loops.release
    try:
        lock = "heteroplane.db.lock" if held == "serving" else "heteroplane.db.leader.lock"
        for argv in (
            ["db", "downgrade", "--revision", "base"],
            ["db", "downgrade", "--revision", "-1"],
            ["db", "upgrade"],
        ):
            err = one_line_refusal(capsys, *argv)
            assert err.startswith(f"heteroplane db: cannot {argv[1]} sqlite:///")
            assert f"a heteroplane service runs on it (pid {os.getpid()} holds {lock})" in err
            assert err.endswith("stop the service first\n")
            assert run_json(capsys, "db", "current")["revision"] == previous
    finally:
        release()
    assert run_json(capsys, "db", "upgrade")["revision"] == NEWEST
    if held == "serving":
        again = lock_sqlite_database(database_url)
        assert again is not None
        try:  # an upgrade with nothing to do changes nothing: not refused
            assert run_json(capsys, "db", "upgrade")["revision"] == NEWEST
        finally:
            again.close()
    assert run_json(capsys, "db", "downgrade", "--revision", "base")["revision"] is None


def test_a_service_cannot_start_while_the_schema_changes(database_url: str) -> None:
    with schema_change_lock(database_url, "downgrade"):
        with pytest.raises(DatabaseInUseError, match=f"pid {os.getpid()}"):
            lock_sqlite_database(database_url)
        leader = sqlite_leader_lock(database_url)
        assert leader is not None and not leader.try_acquire()
    service = lock_sqlite_database(database_url)
    assert service is not None
    service.close()


@pytest.mark.parametrize("action", ["upgrade", "downgrade"])
@pytest.mark.parametrize("revision", ["", " "])
def test_a_blank_revision_is_one_line(
    database_url: str, capsys: pytest.CaptureFixture[str], action: str, revision: str
) -> None:
    """An empty --revision (an unset variable) ended in Alembic's AssertionError, a traceback."""
    with pytest.raises(SystemExit) as caught:
        main(["db", action, "--revision", revision])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert err == (
        f"heteroplane db {action}: argument --revision: no revision in {revision!r}: give head,"
        " base, a revision id (db current names the database's) or a step such as -1\n"
    )
    with pytest.raises(DatabaseError, match=f"cannot {action} .*: no revision given"):
        getattr(migrate, action)(database_url, revision)  # the library says so too


def test_bad_settings_exit_2(
    database_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HETEROPLANE_DATABASE_URL", "mysql://root@db/x")
    with pytest.raises(SystemExit) as caught:
        main(["db", "current"])
    assert caught.value.code == 2
    assert capsys.readouterr().err == (
        "heteroplane db: database_url: unsupported database 'mysql'; use sqlite:///PATH or"
        " postgresql://USER:PASSWORD@HOST/DB\n"
    )


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:"])
@pytest.mark.parametrize(
    "argv",
    [
        ["token", "create", "--scope", "admin"],
        ["token", "list"],
        ["db", "upgrade"],
        ["db", "current"],
        ["db", "downgrade", "--revision", "base"],
    ],
)
def test_an_in_memory_database_is_refused(
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    url: str,
    argv: list[str],
) -> None:
    """It lives only inside the command: token create printed a token stored nowhere, and db
    upgrade migrated it and then said it had no tables (run: heteroplane db upgrade)."""
    monkeypatch.setenv("HETEROPLANE_DATABASE_URL", url)
    err = one_line_refusal(capsys, *argv)
    assert err.startswith(
        f"heteroplane {argv[0]}: database_url: {url} is an in-memory SQLite database: it exists"
        " only inside this command and is gone when it exits"
    )


def test_token_create_upgrades_and_prints_the_token_alone(
    database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["token", "create", "--scope", "operator", "--name", "ci"]) == 0
    out = capsys.readouterr().out
    token = out.strip()
    assert out == token + "\n" and token.startswith("hp_")
    store = Store.from_url(database_url)
    assert tuple(store.verify_token(token) or ()) == ("ci", "operator")
    store.close()
    with pytest.raises(SystemExit):
        main(["token", "create", "--scope", "viewer", "--name", "ci"])
    assert "a token named 'ci' already exists" in capsys.readouterr().err


@pytest.mark.parametrize("name", [" ", "ci ", " ci"])
def test_a_blank_or_padded_token_name_is_refused(
    database_url: str, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """' ' was a token whose name every audit line ('plan 1 applied by  ') and token list
    showed blank, and 'ci ' one beside 'ci' that read the same."""
    err = one_line_refusal(capsys, "token", "create", "--scope", "viewer", "--name", name)
    assert err == (
        f"heteroplane token: name: must not be blank or start or end with a space, got {name!r}\n"
    )


def test_token_list_and_revoke_make_no_database(
    database_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Listing or revoking on a SQLite file that is not there (a wrong database_url) is one line
    and exit 2; no folder or empty database is left behind."""
    for args in (["token", "list"], ["token", "revoke", "--name", "x"]):
        with pytest.raises(SystemExit) as caught:
            main(args)
        assert caught.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "no database at" in err and "heteroplane.db" in err
    assert not (tmp_path / "state").exists()


def test_token_list_and_revoke(database_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "token", "create", "--scope", "infer")
    assert data["scope"] == "infer"
    listed = run_json(capsys, "token", "list")
    assert [t["name"] for t in listed["tokens"]] == [data["name"]]  # type: ignore[index,union-attr]
    assert str(data["token"]) not in json.dumps(listed)
    revoked = run_json(capsys, "token", "revoke", "--name", str(data["name"]))
    assert revoked["revoked_at"] is not None
    with pytest.raises(SystemExit):
        main(["token", "revoke", "--name", "nobody"])
    assert "no token 'nobody'" in capsys.readouterr().err


def test_token_create_from_the_shell(database_url: str) -> None:
    done = subprocess.run(
        [str(HETEROPLANE), "token", "create", "--scope", "admin"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("hp_") and done.stdout.count("\n") == 1
    assert "shown only this once" in done.stderr
