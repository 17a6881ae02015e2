"""The demo's setup (:mod:`controlplane.demo`) in-process: the token file is made once, kept while
it verifies, and replaced (the lost token revoked) when it does not; the app and its first plan
are made once, and a second run on the same service finds them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.demo import (
    DEMO_APP,
    TOKEN_FILE,
    TOKEN_NAME,
    demo_spec,
    ensure_demo_token,
    prepare_demo,
)
from controlplane.service import build_service
from controlplane.settings import Settings
from controlplane.spec import validate_spec
from controlplane.store import Store
from tests.conftest import KAIROS_CSV, needs_shared


@pytest.fixture
def store() -> Iterator[Store]:
    store = Store.from_url("sqlite://", upgrade=True)
    yield store
    store.close()


def tokens(store: Store) -> list[tuple[str, bool]]:
    """(name, revoked) of every token, oldest first."""
    return [(t.name, t.revoked_at is not None) for t in store.list_tokens()]


def test_the_token_file_is_made_once_and_readable_by_its_owner_only(
    store: Store, tmp_path: Path
) -> None:
    said: list[str] = []
    first = ensure_demo_token(store, tmp_path, said.append)
    assert first.created and first.path == tmp_path / TOKEN_FILE
    assert first.principal == (TOKEN_NAME, "admin")
    assert first.path.stat().st_mode & 0o777 == 0o600
    token = first.path.read_text()
    assert token.endswith("\n") and store.verify_token(token.strip()) == first.principal
    assert said == [f"made an admin token {TOKEN_NAME!r}, written to {first.path}"]

    again = ensure_demo_token(store, tmp_path, said.append)
    assert not again.created and again.principal == first.principal
    assert first.path.read_text() == token
    assert tokens(store) == [(TOKEN_NAME, False)]


@pytest.mark.parametrize("damage", ["delete", "garble", "revoke", "not-admin"])
def test_a_token_file_that_no_longer_verifies_is_replaced(
    store: Store, tmp_path: Path, damage: str
) -> None:
    path = ensure_demo_token(store, tmp_path, lambda _: None).path
    if damage == "delete":
        path.unlink()
    elif damage == "garble":
        path.write_text("hp_not-a-token\n")
    elif damage == "revoke":
        store.revoke_token(TOKEN_NAME)
    else:
        path.write_text(store.create_token("viewer", "someone") + "\n")
    if path.exists():
        path.chmod(0o644)  # the new file must be 0600 again

    said: list[str] = []
    replaced = ensure_demo_token(store, tmp_path, said.append)
    assert replaced.created and replaced.principal == (f"{TOKEN_NAME}-2", "admin")
    assert path.stat().st_mode & 0o777 == 0o600
    assert store.verify_token(path.read_text().strip()) == replaced.principal
    demo_tokens = [t for t in tokens(store) if t[0].startswith(TOKEN_NAME)]
    assert demo_tokens == [(TOKEN_NAME, True), (f"{TOKEN_NAME}-2", False)]
    revoked_now = damage != "revoke"
    assert any("revoked" in line for line in said) == revoked_now
    assert not list(tmp_path.glob("*.partial"))


def test_the_demo_spec_is_a_valid_spec_with_an_absolute_profiles_path() -> None:
    spec = validate_spec(demo_spec(Path("relative/samples.csv.gz")))
    assert spec.name == DEMO_APP
    assert Path(spec.models[0].profiles).is_absolute()
    assert spec.budget_usd_per_hr == 10 and spec.slo.latency_ms == 350


@needs_shared
def test_prepare_demo_registers_and_plans_once(tmp_path: Path) -> None:
    service = build_service(Settings(data_dir=tmp_path / "data", provisioner="fake"))
    try:
        said: list[str] = []
        first = prepare_demo(service, KAIROS_CSV, 60.0, said.append)
        assert first.token.created and first.app_created and first.plan_created
        assert first.plan is not None and first.plan.status == "applied"
        assert first.app.applied_plan_id == first.plan.id
        assert first.app.spec["models"][0]["profiles"] == str(KAIROS_CSV.resolve())
        assert any(line.startswith(f"planning {DEMO_APP!r} for 60 qps") for line in said)

        said.clear()
        second = prepare_demo(service, KAIROS_CSV, 60.0, said.append)
        assert not (second.token.created or second.app_created or second.plan_created)
        assert second.app == first.app and second.plan == first.plan
        assert said == [
            f"the app {DEMO_APP!r} is registered already (version {first.app.version})",
            f"plan 1 of {DEMO_APP!r} is applied already",
        ]
        store = service.store
        assert [app.name for app in store.list_apps()] == [DEMO_APP]
        assert [plan.status for plan in store.list_plans(DEMO_APP)] == ["applied"]
        assert [d.kind for d in store.list_decisions(DEMO_APP)] == ["plan_applied"]
        assert tokens(store) == [(TOKEN_NAME, False)]
    finally:
        service.close()
