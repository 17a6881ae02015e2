"""The demo's setup (:mod:`controlplane.service.demo`) in-process: the token file is made once, kept
while it verifies, and replaced (the lost token revoked) when it does not; the family's cascade is
the cheapest as accurate as its best model; the profiles (measured through real worker processes),
the app and its first plan are made once, and a second run on the same service finds them;
profiles measured another way or for other compute curves are measured again, and the app planned
again on them; an rm2 demo app of earlier versions, or a cascade demo of another shape, is
replaced; the demo load runs period after period against a fake service until stopped."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from controlplane.db.store import Store
from controlplane.service import demo
from controlplane.service.build import Service, build_service
from controlplane.service.demo import (
    DEMO_APP,
    DEMO_BUDGET_USD_PER_HR,
    DEMO_INSTANCE_TYPES,
    DEMO_MAX_COUNTS,
    DEMO_SLO_MS,
    PROFILE_BATCH_SIZES,
    PROFILES_FILE,
    TOKEN_FILE,
    TOKEN_NAME,
    DemoFamily,
    DemoLoad,
    choose_cascade,
    demo_spec,
    ensure_demo_plan,
    ensure_demo_profiles,
    ensure_demo_token,
    load_trace,
    prepare_demo,
)
from controlplane.settings import Settings
from controlplane.spec import validate_spec
from estimator.cascades import Cascade, evaluate, load_validation
from estimator.profiles import load_profiles
from provisioners.worker.emulation import EMULATED_COMPUTE
from tests.conftest import KAIROS_CSV, needs_shared

# Timed calls per cell when a test measures the demo's profiles through real workers.
SAMPLES = 2


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


def family_of(tmp_path: Path, cascade: Cascade) -> DemoFamily:
    return DemoFamily(
        tmp_path / "models",
        tmp_path / "models" / "validation.json",
        Path("relative/family.json"),
        cascade,
        0.98,
        0.03,
    )


def test_the_demo_spec_is_a_valid_cascade_spec_with_absolute_paths(tmp_path: Path) -> None:
    cascade = Cascade(("tiny", "medium", "large"), (0.5, 0.6))
    spec = validate_spec(demo_spec(family_of(tmp_path, cascade)))
    assert spec.name == DEMO_APP
    assert spec.model_names == ["tiny", "medium", "large"] == spec.cascade
    assert spec.thresholds == [0.5, 0.6]
    assert spec.validation is not None and Path(spec.validation).is_absolute()
    assert all(Path(m.profiles).is_absolute() for m in spec.models)
    assert spec.budget_usd_per_hr == DEMO_BUDGET_USD_PER_HR and spec.slo.latency_ms == DEMO_SLO_MS
    assert spec.instance_types == ["emu.cpu.small", "emu.cpu.large"]
    assert spec.max_counts == DEMO_MAX_COUNTS and sum(DEMO_MAX_COUNTS.values()) <= 8
    single = validate_spec(demo_spec(family_of(tmp_path, Cascade(("large",), ()))))
    assert single.cascade is None and single.validation is None


@pytest.fixture(scope="module")
def family_cache(trained_family: Path) -> Path:
    """The trained family, once for the run (tests/conftest.py)."""
    return trained_family


def test_the_cascade_is_the_cheapest_within_half_a_point_of_the_best_model(
    family_cache: Path,
) -> None:
    records = load_validation(family_cache / "validation.json")
    compute_ms = {"tiny": 0.016, "small": 0.021, "medium": 0.039, "large": 0.204}
    cascade, accuracy, compute = choose_cascade(records, compute_ms)
    # Chosen on the choose half of the records (the held-out protocol), scored on the other.
    choose, score = records.split()
    best_alone = max(choose.model_accuracy(m) for m in compute_ms)
    assert len(cascade.models) >= 2 and cascade.models[-1] == "large"
    assert evaluate(cascade, choose).accuracy >= best_alone - 0.005 - 1e-12
    assert accuracy == evaluate(cascade, score).accuracy
    assert compute < compute_ms["large"] / 2


@pytest.fixture(scope="module")
def measured_profiles(
    family_cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[str]]:
    """The demo's profiles, measured once for this module through real workers of local.cpu and
    the demo's types, and what the measurement said."""
    data_dir = tmp_path_factory.mktemp("measured")
    said: list[str] = []
    path, measured = ensure_demo_profiles(data_dir, family_cache, SAMPLES, said.append)
    assert measured
    return path, said


def data_dir_with(tmp_path: Path, family_cache: Path, profiles: Path | None) -> Path:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "models").symlink_to(family_cache, target_is_directory=True)
    if profiles is not None:
        (data_dir / PROFILES_FILE).parent.mkdir(parents=True)
        shutil.copy(profiles, data_dir / PROFILES_FILE)
    return data_dir


@pytest.fixture
def service(
    tmp_path: Path, family_cache: Path, measured_profiles: tuple[Path, list[str]]
) -> Iterator[Service]:
    """The service on the fake provisioner, its data directory holding the family and the
    module's measured profiles."""
    data_dir = data_dir_with(tmp_path, family_cache, measured_profiles[0])
    service = build_service(Settings(data_dir=data_dir, provisioner="fake"))
    try:
        yield service
    finally:
        service.close()


def test_the_profiles_are_measured_through_the_workers_of_the_demo_types(
    measured_profiles: tuple[Path, list[str]],
) -> None:
    path, said = measured_profiles
    assert said[0].endswith("is missing")
    assert any(line.startswith("measuring the family's latency through a worker") for line in said)
    profiles = load_profiles(path)
    document = json.loads(path.read_text())
    assert document["measurement"] == "serving_path"
    assert set(document["compute"]["models"]) == set(EMULATED_COMPUTE)
    for model, curve in EMULATED_COMPUTE.items():
        for name in ("local.cpu", *DEMO_INSTANCE_TYPES):
            profile = profiles.get_profile(model, name)
            assert tuple(profile.batch_sizes.tolist()) == PROFILE_BATCH_SIZES
            assert all(cell.size == SAMPLES for cell in profile.samples_ms)
        # What a caller of an emulated worker sees: at least the compute it pads to, tens of ms.
        slow = profiles.get_profile(model, "emu.cpu.small")
        floor = [curve.latency_ms(b) / 0.5 for b in PROFILE_BATCH_SIZES]
        assert all(m >= f for m, f in zip(slow.mean_ms.tolist(), floor, strict=True))
        assert slow.mean_latency_ms(1) >= 10.0


def test_profiles_measured_another_way_or_for_other_compute_are_measured_again(
    tmp_path: Path, family_cache: Path, measured_profiles: tuple[Path, list[str]]
) -> None:
    data_dir = data_dir_with(tmp_path, family_cache, measured_profiles[0])
    path = data_dir / PROFILES_FILE
    said: list[str] = []
    assert ensure_demo_profiles(data_dir, family_cache, SAMPLES, said.append) == (path, False)
    assert said == []
    document = json.loads(path.read_text())
    for change, why in [
        ({"measurement": "compute_only"}, "was not measured through the serving path"),
        ({"compute": {"models": {}}}, "padding to other compute curves"),
    ]:
        path.write_text(json.dumps(document | change))
        models = list(EMULATED_COMPUTE)
        stale = demo._stale_profiles(path, models, ["emu.cpu.small"], EMULATED_COMPUTE)
        assert stale is not None and why in stale
    del document["measurement"]
    path.write_text(json.dumps(document))  # an older version's file: measured again
    assert ensure_demo_profiles(data_dir, family_cache, 1, said.append) == (path, True)
    assert said[0] == f"{path} was not measured through the serving path"
    assert json.loads(path.read_text())["measurement"] == "serving_path"


def test_prepare_demo_registers_and_plans_once(service: Service) -> None:
    said: list[str] = []
    first = prepare_demo(service, 12.0, said.append, profile_samples=SAMPLES)
    assert first.token.created and first.app_created and first.plan_created
    assert not first.family.profiles_measured  # the module's profiles were there
    assert first.plan is not None and first.plan.status == "applied"
    assert first.app.applied_plan_id == first.plan.id
    spec = first.app.spec
    assert spec["cascade"] == list(first.family.cascade.models)
    assert spec["validation"] == str(first.family.validation.resolve())
    assert spec["models"][0]["profiles"] == str(service.settings.data_dir / PROFILES_FILE)
    # The family went through the model registry as a user's models do: each model of the
    # cascade names its pushed TorchScript version, and the reconciler launches workers with it.
    registry = service.app.state.services.registry
    for model in spec["models"]:
        record = registry.resolve(model["artifact"])
        assert (record.name, record.format) == (model["name"], "torchscript")
        assert record.signature.outputs[0].name == "logits"
    assert {r.name for r in registry.versions()} == {"tiny", "small", "medium", "large"}
    stages = first.plan.document["stages"]
    assert len(stages) == len(spec["cascade"])
    # The plan predicts what a batch costs through the workers: tens of ms per stage.
    assert all(10.0 <= stage["predicted_p99_ms"] <= DEMO_SLO_MS for stage in stages)
    assert any(line.startswith(f"planning {DEMO_APP!r} for 12 qps") for line in said)

    said.clear()
    second = prepare_demo(service, 12.0, said.append, profile_samples=SAMPLES)
    assert not (second.token.created or second.app_created or second.plan_created)
    assert second.app == first.app and second.plan == first.plan
    assert len(registry.versions()) == 4  # the same bytes: no new versions
    assert said == [
        f"the app {DEMO_APP!r} is registered already (version {first.app.version})",
        f"plan {first.plan.id} of {DEMO_APP!r} is applied already",
    ]
    store = service.store
    assert [app.name for app in store.list_apps()] == [DEMO_APP]
    assert [plan.status for plan in store.list_plans(DEMO_APP)] == ["applied"]
    assert [d.kind for d in store.list_decisions(DEMO_APP)] == ["plan_applied"]
    assert tokens(store) == [(TOKEN_NAME, False)]


def test_a_cascade_demo_of_another_shape_is_replaced_with_its_budget_kept(
    service: Service,
) -> None:
    said: list[str] = []
    first = prepare_demo(service, 12.0, said.append, profile_samples=SAMPLES)
    older = first.app.spec | {"slo": {"latency_ms": 100.0, "percentile": 99.0}}
    service.store.update_app(DEMO_APP, older | {"budget_usd_per_hr": 0.45}, who="someone")
    said.clear()
    again = prepare_demo(service, 12.0, said.append, profile_samples=SAMPLES)
    assert again.app_created and again.plan_created
    assert again.app.spec["slo"]["latency_ms"] == DEMO_SLO_MS
    assert again.app.budget_usd_per_hr == 0.45
    assert any("is a demo of another shape" in line for line in said)


def test_a_start_keeps_what_a_rollout_pinned_and_adds_no_plan(service: Service) -> None:
    """A start moved the app to the newest version holding the family's bytes (a user pushed
    the same file again, after another) and replaced the spec a promoted rollout had written
    (its pin, its validation records) and its plan, outside any rollout (a tester)."""
    from provisioners.worker import family as fam

    first = prepare_demo(service, 12.0, lambda _: None, profile_samples=SAMPLES)
    registry = service.app.state.services.registry
    cache_dir = first.family.cache_dir
    # The newest version's own file again makes none: another file first.
    registry.push("tiny", fam.export_torchscript("small", cache_dir), "torchscript")
    again_pushed = registry.push("tiny", fam.export_torchscript("tiny", cache_dir), "torchscript")
    assert again_pushed.version == 3
    tiny = [m["artifact"] for m in first.app.spec["models"] if m["name"] == "tiny"]
    if tiny:  # the cascade serves tiny: a rollout to the third push promoted
        promoted = first.app.spec | {
            "models": [
                m | {"artifact": "tiny@3"} if m["name"] == "tiny" else m
                for m in first.app.spec["models"]
            ],
            "validation": str(service.settings.data_dir / "rollouts" / "demo-tiny-1.json"),
        }
        service.store.update_app(DEMO_APP, promoted, who="rollout 1")
    pinned = service.store.get_app(DEMO_APP)
    said: list[str] = []
    again = prepare_demo(service, 12.0, said.append, profile_samples=SAMPLES)
    assert not (again.app_created or again.plan_created)
    assert again.app.spec == pinned.spec  # pins and records as the rollout left them
    assert [p.status for p in service.store.list_plans(DEMO_APP)] == ["applied"]
    assert not any("another shape" in line for line in said)


def test_a_start_on_a_demo_being_taken_down_changes_nothing_and_says_how_to_finish(
    service: Service,
) -> None:
    """It replaced the spec and planned, then failed on the teardown with a remedy that needed
    the service it refused to run (a tester)."""
    from controlplane.apps.teardown import request_teardown
    from controlplane.errors import ConflictError

    first = prepare_demo(service, 12.0, lambda _: None, profile_samples=SAMPLES)
    service.store.record_instance(
        DEMO_APP, request_id="demo-x-1", instance_type="emu.cpu.small", price_usd_per_hr=0.05,
        state="running",
    )  # fmt: skip
    request_teardown(service.store, DEMO_APP, who="test")
    before = service.store.get_app(DEMO_APP)
    with pytest.raises(ConflictError, match="finish it with heteroplane demo --down"):
        prepare_demo(service, 12.0, lambda _: None, profile_samples=SAMPLES)
    assert service.store.get_app(DEMO_APP) == before
    assert [p.id for p in service.store.list_plans(DEMO_APP)] == [first.plan.id]


def test_profiles_measured_anew_are_planned_on_again(
    tmp_path: Path,
    family_cache: Path,
    measured_profiles: tuple[Path, list[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data_dir = data_dir_with(tmp_path, family_cache, measured_profiles[0])
    # The measurement gives the module's numbers again (a real one, noisy with a few samples,
    # could choose another cascade; that the workers are timed is tested above).
    found = load_profiles(measured_profiles[0])
    measured = [found[key] for key in sorted(found)]
    monkeypatch.setattr(demo.profiler, "measure_serving_path", lambda *a, **k: measured)
    service = build_service(Settings(data_dir=data_dir, provisioner="fake"))
    try:
        first = prepare_demo(service, 12.0, lambda _: None, profile_samples=SAMPLES)
        assert first.plan is not None
        # Profiles that do not cover the family: measured again, and the plan made again on them.
        (data_dir / PROFILES_FILE).write_text("not a profile file")
        said: list[str] = []
        again = prepare_demo(service, 12.0, said.append, profile_samples=SAMPLES)
    finally:
        service.close()
    assert again.family.profiles_measured and not again.app_created
    assert any(line.startswith("measuring the family's latency") for line in said)
    assert "the profiles were measured anew: planning 'demo' again on them" in said
    assert again.plan is not None and again.plan.id != first.plan.id and again.plan_created
    assert ("large", "emu.cpu.small") in load_profiles(data_dir / PROFILES_FILE)


@needs_shared
def test_an_older_rm2_demo_app_is_replaced_by_the_cascade_and_planned_again(
    service: Service,
) -> None:
    said: list[str] = []
    token = ensure_demo_token(service.store, service.settings.data_dir, said.append)
    old = {
        "name": DEMO_APP,
        "models": [{"name": "rm2", "profiles": str(KAIROS_CSV.resolve())}],
        "slo": {"latency_ms": 350, "percentile": 99},
        "budget_usd_per_hr": 10,
        "instance_types": ["g4dn.xlarge", "c5n.2xlarge", "r5n.large", "t3.xlarge"],
    }
    service.store.create_app(old, who=token.principal.name)
    services = service.app.state.services
    old_plan, _ = ensure_demo_plan(services, token.principal, 60.0, said.append)
    assert old_plan is not None

    state = prepare_demo(service, 20.0, said.append, profile_samples=2)
    assert state.app_created and state.plan_created
    assert state.plan is not None and state.plan.id != old_plan.id
    assert state.app.spec["instance_types"] == ["emu.cpu.small", "emu.cpu.large"]
    assert state.app.budget_usd_per_hr == DEMO_BUDGET_USD_PER_HR
    assert any("is an older demo: replacing its spec" in line for line in said)
    kinds = [d.kind for d in service.store.list_decisions(DEMO_APP)]
    assert kinds == ["plan_applied", "plan_applied"]


def test_the_demo_load_is_a_day_like_poisson_trace_of_validation_samples() -> None:
    first = load_trace(0, 719, mean_qps=10.0, period_s=180.0)
    again = load_trace(0, 719, mean_qps=10.0, period_s=180.0)
    other = load_trace(1, 719, mean_qps=10.0, period_s=180.0)
    assert np.array_equal(first.arrival_s, again.arrival_s)
    assert not np.array_equal(first.arrival_s[:10], other.arrival_s[:10])
    assert first.sample_id is not None and first.sample_id.min() >= 0
    assert first.sample_id.max() < 719 and set(first.batch_size.tolist()) == {1}
    # Low at the start and the end of the period, high in the middle.
    third = np.histogram(first.arrival_s, bins=3, range=(0.0, 180.0))[0]
    assert third[1] > third[0] and third[1] > third[2]
    assert 0.7 * 1800 < len(first) < 1.3 * 1800


def test_the_demo_load_runs_period_after_period_until_stopped() -> None:
    from tests.unit.test_loadgen import FakeService

    fake = FakeService()
    lines: list[str] = []
    two_periods = threading.Event()

    def progress(line: str) -> None:
        lines.append(line)
        if sum(line.startswith("demo load: ") and "queries in" in line for line in lines) >= 2:
            two_periods.set()

    inputs = np.zeros((5, 64), dtype=np.float32)  # sample ids 7.. would be scripted failures
    load = DemoLoad(fake.url, "hp_admin-token", inputs, progress, mean_qps=20.0, period_s=1.0)
    try:
        load.start()
        assert two_periods.wait(timeout=60.0), lines
    finally:
        load.stop()
        fake.close()
    assert lines[0].startswith("demo load: started, Poisson arrivals from 4 to 36 qps")
    assert "errors 0" in lines[1] and "answered" in lines[1]
