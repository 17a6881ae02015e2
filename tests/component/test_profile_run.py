"""Profile runs (controlplane.apps.profile_run) and what the reconciler and the API do with
registered models: the fake provisioner (its addresses pointed at a fake OIP v2 worker on
loopback), a real SQLite store through the migrations, a fake clock.

- a run records a row per worker before launching it with the app's artifacts and the
  profile-run tags, sends v2 batches matching the signature at every batch size, stores the
  profile document, records a decision and terminates the workers, rows and all (also when a
  worker refuses a batch);
- the budget: the fleet, the provider's instances of the app without a row and one worker per
  type must fit, else a 409 naming the cost;
- the reconciler launches an artifact app's workers with its artifacts; it leaves a live profile
  run's workers out of the fleet but in the budget, reaps them once their run stops beating,
  terminates a profile worker without a row, and ``app down`` takes them;
- the API: registering pins ``NAME`` to ``NAME@latest``; a plan preview is refused (409, one
  line) until the profiles are measured; ``POST /v1/apps/{app}/profiles`` measures them.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from controlplane.apps.profile_run import (
    PROFILE_RUN_TAG,
    ProfileRunInProgressError,
    ProfileRunRequest,
    ProfilingInterruptedError,
    ProfilingRequestError,
    check_profile_run,
    run_profile,
)
from controlplane.apps.profiler import ProfilingError
from controlplane.apps.resolver import AppResolver, spec_document
from controlplane.apps.teardown import request_teardown
from controlplane.clock import FakeClock
from controlplane.db.store import InstanceRecord, Store
from controlplane.errors import ConflictError, ProfilingBudgetError
from controlplane.loops.reconciler import Orphan, Reconciler, catalog_pricing
from controlplane.policies.lifecycle import is_profile_worker
from controlplane.service.app import create_app
from controlplane.service.build import app_artifacts
from controlplane.settings import Settings
from estimator.catalog import default_catalog
from provisioners.artifacts import FAMILY_SIGNATURE, numpy_dtype
from provisioners.base import APP_TAG, INSTANCE_TAG, LaunchRequest, ProvisionedInstance
from provisioners.fake import FakeProvisioner
from provisioners.worker.oip import HEADER_LENGTH
from tests.dying_writes import decision_write_fails

SMALL, GPU = "emu.cpu.small", "emu.gpu"
APP = "digits"
SHA = "cd" * 32


@dataclass
class WorkerLog:
    calls: list[tuple[str, list[int], str, str]] = field(default_factory=list)
    status: int = 200


class FakeV2Worker:
    """A threaded OIP v2 worker on loopback: ready, and answers every infer with ten logits per
    row (or ``log.status``), recording (model, shape, datatype, input name)."""

    def __init__(self) -> None:
        self.log = WorkerLog()
        log = self.log

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_args: object) -> None:
                pass

            def _send(self, status: int, document: object) -> None:
                body = json.dumps(document).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._send(200 if self.path == "/v2/health/ready" else 404, {"ready": True})

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                # The transport's encoding: binary tensors after a JSON part this long.
                size = int(self.headers[HEADER_LENGTH])
                body = json.loads(raw[:size])
                parts = self.path.split("/")  # ['', 'v2', 'models', m, 'infer']
                (tensor,) = body["inputs"]
                log.calls.append((parts[3], tensor["shape"], tensor["datatype"], tensor["name"]))
                width = np.dtype(numpy_dtype(tensor["datatype"])).itemsize
                count = int(np.prod(tensor["shape"]))
                assert tensor["parameters"]["binary_data_size"] == len(raw) - size == count * width
                if log.status != 200:
                    self._send(log.status, {"error": "input: wrong shape"})
                    return
                rows = tensor["shape"][0]
                self._send(
                    200,
                    {
                        "model_name": parts[3],
                        "outputs": [
                            {
                                "name": "logits",
                                "datatype": "FP32",
                                "shape": [rows, 10],
                                "data": [0.0] * (rows * 10),
                            }
                        ],
                    },
                )

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Addressed(FakeProvisioner):
    """The fake provisioner, every instance's address the fake worker's; remembers requests."""

    def __init__(self, address: str) -> None:
        super().__init__(running_on_launch=True)
        self.worker_address = address
        self.requests: list[LaunchRequest] = []

    def launch(self, request: LaunchRequest) -> list[ProvisionedInstance]:
        self.requests.append(request)
        return [replace(i, address=self.worker_address) for i in super().launch(request)]

    def list(self, tags: Mapping[str, str]) -> list[ProvisionedInstance]:
        return [replace(i, address=self.worker_address) for i in super().list(tags)]


def spec(budget: float = 5.0, types: tuple[str, ...] = (SMALL, GPU)) -> dict[str, Any]:
    return {
        "name": APP,
        "models": [{"name": "small", "artifact": "digits-small"}],
        "slo": {"latency_ms": 300},
        "budget_usd_per_hr": budget,
        "instance_types": list(types),
    }


@pytest.fixture
def worker() -> Iterator[FakeV2Worker]:
    found = FakeV2Worker()
    yield found
    found.close()


@dataclass
class World:
    store: Store
    resolver: AppResolver
    provisioner: Addressed
    clock: FakeClock
    data_dir: Path


@pytest.fixture
def world(tmp_path: Path, worker: FakeV2Worker) -> Iterator[World]:
    clock = FakeClock()
    store = Store.from_url(f"sqlite:///{tmp_path / 'hp.db'}", clock, upgrade=True)
    store.add_model_version(
        "digits-small", 1, "onnx", SHA, 10, FAMILY_SIGNATURE, "file:///registry/s1.onnx"
    )
    resolver = AppResolver(
        tmp_path, artifacts=store.get_model_version, measured=store.get_app_profiles
    )
    yield World(store, resolver, Addressed(worker.address), clock, tmp_path)
    store.close()


def register(world: World, document: dict[str, Any]) -> None:
    resolved = world.resolver.check(document)
    world.store.create_app(spec_document(resolved.spec), who="test")


def profile(world: World, **request: Any) -> Any:
    return run_profile(
        world.store,
        world.resolver,
        world.provisioner,
        world.clock,
        APP,
        ProfileRunRequest(**{"batch_sizes": (1, 4), "samples": 3, "warmup": 1, **request}),
        who="tester",
        worker_port=8080,
        rng=np.random.default_rng(0),
        sleep=lambda _s: None,
    )


def live(provisioner: FakeProvisioner) -> list[ProvisionedInstance]:
    return [i for i in provisioner.list({}) if i.state in ("pending", "running")]


def test_a_run_measures_through_one_worker_per_type_stores_and_stops_them(
    world: World, worker: FakeV2Worker
) -> None:
    register(world, spec())
    assert world.resolver.resolve(world.store.get_app(APP).spec).unprofiled
    result = profile(world)
    # One worker per type, with the app's artifact, the app's tags and its row's id.
    assert sorted(r.instance_type for r in world.provisioner.requests) == [SMALL, GPU]
    rows = {r.id: r for r in world.store.list_instances(APP)}
    for request in world.provisioner.requests:
        (ref,) = request.artifacts
        assert (ref.name, ref.model, ref.version, ref.sha256) == ("small", "digits-small", 1, SHA)
        assert request.tags[PROFILE_RUN_TAG] == APP and request.tags[APP_TAG] == APP
        row = rows[request.tags[INSTANCE_TAG]]
        assert is_profile_worker(row.request_id) and row.request_id == request.request_id
        # Recorded before the launch, ended after the run.
        events = world.store.list_instance_events(instance_id=row.id)
        assert [e.to_state for e in events] == ["requested", "pending", "terminating", "terminated"]
    assert live(world.provisioner) == []  # terminated after
    # (1 warm-up + 3 timed) rounds x 2 batch sizes x 2 types, each one FP32 [b, 64] batch.
    assert len(worker.log.calls) == 16
    assert {(c[0], tuple(c[1]), c[2], c[3]) for c in worker.log.calls} == {
        ("small", (1, 64), "FP32", "input"),
        ("small", (4, 64), "FP32", "input"),
    }
    assert [(p.model, p.instance_type) for p in result.profiles] == [
        ("small", SMALL),
        ("small", GPU),
    ]
    assert all(cell.size == 3 for p in result.profiles for cell in p.samples_ms)
    stored = world.store.get_app_profiles(APP)
    assert stored == dict(result.document)
    assert stored["measurement"] == "profile_run"
    resolved = world.resolver.resolve(world.store.get_app(APP).spec)
    assert not resolved.unprofiled
    assert resolved.profile("small", GPU).batch_sizes.tolist() == [1, 4]
    (decision,) = [d for d in world.store.list_decisions(APP) if d.kind == "profiles_measured"]
    assert "tester" in decision.reason and decision.numbers["instance_types"] == [SMALL, GPU]


def test_a_run_whose_decision_was_not_written_stores_nothing_either(world: World) -> None:
    """The write of the run's decision fails (the process dies there): its profiles are not
    stored either, its workers end, and the run again stores them and says it once. The
    decision used to be written after the profiles, in a transaction of its own: the profiles
    were stored and never said."""
    register(world, spec())
    with decision_write_fails("latency profiles of small measured") as failing:
        with pytest.raises(RuntimeError, match="died writing the decision"):
            profile(world)
        assert failing == []
    assert world.store.get_app_profiles(APP) is None
    assert world.store.list_decisions(APP, kinds=["profiles_measured"]) == []
    assert live(world.provisioner) == []
    profile(world)
    assert world.store.get_app_profiles(APP) is not None
    assert len(world.store.list_decisions(APP, kinds=["profiles_measured"])) == 1


def test_a_run_on_some_types_keeps_the_other_types_profiles(world: World) -> None:
    """A full run, then one on SMALL alone (--types; the budget may ask for it): SMALL's
    profiles are the new run's, GPU's kept, and the app resolves (plans, serves) as before: it
    had been left with SMALL's alone, every query 503."""
    register(world, spec())
    first = profile(world)
    again = profile(world, types=(SMALL,), batch_sizes=(1, 2))
    stored = world.store.get_app_profiles(APP)
    assert stored is not None
    measured = {(e["model"], e["instance_type"]): e["batch_sizes"] for e in stored["profiles"]}
    assert measured == {("small", SMALL): [1, 2], ("small", GPU): [1, 4]}
    assert [(p.model, p.instance_type) for p in again.profiles] == [("small", SMALL)]
    assert first.document["profiles"][1] in stored["profiles"]  # GPU's, as measured first
    resolved = world.resolver.resolve(world.store.get_app(APP).spec)
    assert not resolved.unprofiled
    assert resolved.profile("small", GPU).batch_sizes.tolist() == [1, 4]


def test_a_worker_that_refuses_a_batch_fails_the_run_and_the_workers_stop(
    world: World, worker: FakeV2Worker
) -> None:
    register(world, spec())
    worker.log.status = 400
    with pytest.raises(ProfilingError, match="HTTP 400: input: wrong shape"):
        profile(world, types=(SMALL,))
    assert len(world.provisioner.requests) == 1
    assert live(world.provisioner) == []
    assert [r.state for r in world.store.list_instances(APP)] == ["terminated"]
    assert world.store.get_app_profiles(APP) is None


def test_a_run_whose_worker_the_budget_guard_ends_is_a_conflict_saying_so(
    world: World, worker: FakeV2Worker
) -> None:
    """A budget cut (or app down) mid-run ended the workers and the run answered 502
    profiling_failed "worker is stopping" (a tester): it is a 409 naming why."""
    register(world, spec())
    listed = world.provisioner.list

    def guard_ends_it(tags: Any) -> Any:  # as the run waits for its worker to be ready
        for r in world.store.list_instances(APP, states=["pending"]):
            reason = "the fleet and its profile workers cost 0.6 USD/hr, over the budget"
            world.store.transition_instance(r.id, "terminating", reason=reason)
        worker.log.status = 503  # the agent, told to stop, refuses what comes
        return listed(tags)

    world.provisioner.list = guard_ends_it  # type: ignore[method-assign]
    with pytest.raises(ProfilingInterruptedError) as caught:
        profile(world, types=(SMALL,))
    assert str(caught.value).startswith(
        f"profile run of {APP} stopped: its {SMALL} worker was ended during the run: the fleet"
        " and its profile workers cost 0.6 USD/hr, over the budget"
    )
    assert isinstance(caught.value, ConflictError)  # a 409
    assert live(world.provisioner) == []
    assert world.store.get_app_profiles(APP) is None


@pytest.mark.parametrize(
    ("max_bytes", "said"),
    [
        (100, "takes 256 bytes as binary tensors, past the largest inference body,"
              " 100 bytes (the setting oip_body_max_bytes): the model cannot be served at that"
              " setting"),
        (600, "takes 1,024 bytes as binary tensors, past the largest"
              " inference body, 600 bytes (the setting oip_body_max_bytes): profile smaller batch"
              " sizes (--batch-sizes)"),
    ],
)  # fmt: skip
def test_a_batch_past_the_largest_body_is_refused_before_any_worker_starts(
    world: World, max_bytes: int, said: str
) -> None:
    """The run built each batch in the control plane's memory whatever its size (a declared
    input of [N, 4, 100000000]: 12.8 GB, then a 500)."""
    register(world, spec())
    with pytest.raises(ProfilingRequestError) as caught:
        run_profile(
            world.store, world.resolver, world.provisioner, world.clock, APP,
            ProfileRunRequest(batch_sizes=(1, 4), samples=3, warmup=1), who="tester",
            worker_port=8080, max_batch_bytes=max_bytes,
        )  # fmt: skip
    message = str(caught.value)
    assert message.startswith(
        "batch_sizes: one row of " if max_bytes == 100 else "batch_sizes: a batch of 4 rows of "
    ) and message.endswith(said)
    assert world.provisioner.requests == [] and world.store.list_instances(APP) == []


def test_the_workers_must_fit_the_budget_next_to_the_fleet(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    prices = {t.name: t.price_usd_per_hr for t in default_catalog().values()}
    register(world, spec(budget=prices[SMALL] + prices[GPU] - 0.001))
    with pytest.raises(ProfilingBudgetError) as refused:
        profile(world)
    assert f"{prices[SMALL] + prices[GPU]:.4g} USD/hr" in str(refused.value)
    assert len(str(refused.value).splitlines()) == 1
    assert world.provisioner.requests == []
    # Refused before any row is written (a rollout waiting for the budget retried every few
    # seconds, each try writing two rows that read as cost over the budget until refused).
    assert world.store.list_instances(APP) == []
    # Checked first, the same refusal, and nothing recorded.
    with pytest.raises(ProfilingBudgetError) as checked:
        check_profile_run(world.store, world.resolver, world.provisioner, APP, ProfileRunRequest())
    assert str(checked.value) == str(refused.value)
    assert world.store.list_instances(APP) == []

    # A launch recorded between that check and the workers' rows: refused once they are
    # written, the rows ending unlaunched, saying the budget refused them.
    world.store.change_budget(APP, prices[SMALL] + prices[GPU] + 0.001, reason="t", who="t")
    recorded = world.store.record_instance
    racing: list[str] = []

    def with_a_launch_beside(app: str, **row: Any) -> Any:
        if not racing:
            racing.append(
                recorded(
                    APP, request_id="r-0", instance_type=SMALL, price_usd_per_hr=0.01, reason="t"
                ).id
            )
        return recorded(app, **row)

    monkeypatch.setattr(world.store, "record_instance", with_a_launch_beside)
    with pytest.raises(ProfilingBudgetError) as refused:
        profile(world)
    monkeypatch.undo()
    assert world.provisioner.requests == []
    ended_rows = [r for r in world.store.list_instances(APP) if r.id not in racing]
    assert len(ended_rows) == 2 and {r.state for r in ended_rows} == {"failed"}
    for row in ended_rows:
        (ended,) = [
            e.reason
            for e in world.store.list_instance_events(instance_id=row.id)
            if e.to_state == "failed"
        ]
        assert ended == f"refused by the budget, not launched: {refused.value}", ended
    world.store.transition_instance(racing[0], "failed", reason="t")
    world.store.change_budget(APP, prices[SMALL] + prices[GPU] - 0.001, reason="t", who="t")
    profile(world, types=(SMALL,))  # one type fits
    # A running fleet counts: with one GPU instance kept, not even the small type fits.
    world.store.record_instance(
        APP, request_id="r-1", instance_type=GPU, price_usd_per_hr=prices[GPU], reason="test"
    )
    with pytest.raises(ProfilingBudgetError):
        profile(world, types=(SMALL,))


def test_a_refusal_names_the_other_profile_workers_beside_the_fleet(world: World) -> None:
    """The workers of another profile run or a rollout count toward the budget next to the
    fleet, and the refusal says how much of the amount they are: a rollout's profile run
    waiting for a killed run's worker to be ended said "on top of the fleet's 0.2 USD/hr" of a
    fleet of 0.1 USD/hr."""
    small = {t.name: t.price_usd_per_hr for t in default_catalog().values()}[SMALL]
    register(world, spec(budget=small * 2.5))
    for request_id in ("r-1", f"profile:rollout-{APP}-7-x-{SMALL}-1"):
        world.store.record_instance(
            APP, request_id=request_id, instance_type=SMALL, price_usd_per_hr=small, reason="t"
        )
    with pytest.raises(ProfilingBudgetError) as refused:
        profile(world, types=(SMALL,))
    assert refused.value.fleet_usd_per_hr == pytest.approx(2 * small)
    said = str(refused.value)
    assert f"on top of the app's {2 * small:.4g} USD/hr ({small:.4g} USD/hr of it the" in said
    assert "the workers of other profile runs, a rollout's among them" in said
    assert world.provisioner.requests == []
    # Without them, the fleet alone, as before.
    (rollouts,) = [r for r in world.store.list_instances(APP) if r.request_id != "r-1"]
    world.store.transition_instance(rollouts.id, "failed", reason="t")
    world.store.record_instance(
        APP, request_id="r-2", instance_type=SMALL, price_usd_per_hr=small, reason="t"
    )
    with pytest.raises(ProfilingBudgetError) as refused:
        profile(world, types=(SMALL,))
    assert f"on top of the fleet's {2 * small:.4g} USD/hr, over" in str(refused.value)


def test_the_reconciler_launches_an_artifact_app_with_its_artifacts(world: World) -> None:
    register(world, spec())
    reconciler = Reconciler(
        world.store,
        world.provisioner,
        world.clock,
        catalog_pricing(default_catalog()),
        desired_fleet=lambda _app: {SMALL: 1},
        artifacts=app_artifacts(world.resolver),
    )
    reconciler.run_once()
    (request,) = world.provisioner.requests
    (ref,) = request.artifacts
    assert ref.to_arg() == f"small:digits-small:1:onnx:{SHA}:file:///registry/s1.onnx"
    assert request.tags[APP_TAG] == APP


def reconciler_of(world: World, fleet: Mapping[str, int] | None = None) -> Reconciler:
    return Reconciler(
        world.store,
        world.provisioner,
        world.clock,
        catalog_pricing(default_catalog()),
        desired_fleet=lambda _app: dict(fleet or {}),
        profile_run_timeout_s=40.0,
    )


def profile_row(world: World, run: str, instance_type: str, reason: str) -> InstanceRecord:
    """A row of profile run ``run``'s worker, as a run records it (the run itself not running)."""
    price = default_catalog()[instance_type].price_usd_per_hr
    return world.store.record_instance(
        APP,
        request_id=f"profile:{APP}-{run}-{instance_type}",
        instance_type=instance_type,
        price_usd_per_hr=price,
        reason=reason,
    )


def launch_profile_worker(world: World, instance_type: str = SMALL) -> str:
    """A profile run's worker as a run records and launches it (the run itself not running)."""
    row = profile_row(world, "0000", instance_type, "test")
    tags = {APP_TAG: APP, PROFILE_RUN_TAG: APP, INSTANCE_TAG: row.id}
    (instance,) = world.provisioner.launch(LaunchRequest(row.request_id, instance_type, 1, tags))
    world.store.transition_instance(
        row.id, "pending", reason="launched", provider_id=instance.provider_id
    )
    return row.id


def test_a_live_profile_run_counts_against_the_budget_but_not_the_fleet_and_is_reaped_when_gone(
    world: World,
) -> None:
    prices = {t.name: t.price_usd_per_hr for t in default_catalog().values()}
    # Room for the GPU profile worker and one small instance, not two.
    register(world, spec(budget=prices[GPU] + prices[SMALL] * 1.5))
    row_id = launch_profile_worker(world, GPU)
    reconciler = reconciler_of(world, {SMALL: 2})
    reconciler.run_once()
    rows = world.store.list_instances(APP)
    assert world.store.get_instance(row_id).state == "running"  # followed, not ended
    # The fleet launched one small (the profile worker's cost is reserved), not a GPU.
    fleet = [r for r in rows if not is_profile_worker(r.request_id)]
    assert [r.instance_type for r in fleet] == [SMALL]
    capped = world.store.list_decisions(APP, kinds=["budget_capped"])
    assert capped and capped[-1].numbers["wanted"] == {SMALL: 1}
    # The run beats: its worker stays past the timeout.
    world.clock.advance(30)
    world.store.touch_instances([row_id])
    world.clock.advance(30)
    reconciler.run_once()
    assert world.store.get_instance(row_id).state == "running"
    # The run is gone (no beat for longer than the timeout): the reconciler ends the worker.
    world.clock.advance(41)
    report = reconciler.run_once()
    assert world.store.get_instance(row_id).state == "terminating"
    (ended,) = [
        a for a in report.apps[APP].actions if getattr(a, "cause", "") == "profile_run_gone"
    ]
    assert ended.instance_ids == (row_id,)
    reconciler.run_once()
    assert world.store.get_instance(row_id).state == "terminated"
    assert not any(i.instance_type == GPU for i in live(world.provisioner))


def test_a_profile_worker_without_a_row_is_terminated_and_counts_until_then(
    world: World,
) -> None:
    prices = {t.name: t.price_usd_per_hr for t in default_catalog().values()}
    register(world, spec(budget=prices[GPU] + prices[SMALL] * 0.5))
    # A worker launched by a run that crashed before recording its provider id, row lost too.
    tags = {APP_TAG: APP, PROFILE_RUN_TAG: APP}
    world.provisioner.launch(LaunchRequest("profile:lost", GPU, 1, tags))
    with pytest.raises(ProfilingBudgetError) as refused:
        profile(world, types=(SMALL,))
    assert refused.value.fleet_usd_per_hr == pytest.approx(prices[GPU])
    report = reconciler_of(world).run_once()
    assert report.apps[APP].count(Orphan) == 1
    assert live(world.provisioner) == []
    (orphan,) = [r for r in world.store.list_instances(APP) if r.request_id.startswith("orphan:")]
    assert orphan.instance_type == GPU
    # Nothing left unrecorded: the run fits now.
    world.provisioner.requests.clear()
    profile(world, types=(SMALL,))
    assert len(world.provisioner.requests) == 1


def test_app_down_ends_a_profile_runs_workers(world: World) -> None:
    register(world, spec())
    row_id = launch_profile_worker(world)
    assert request_teardown(world.store, APP, "tester").deleted is False
    reconciler = reconciler_of(world)
    reconciler.run_once()
    assert world.store.get_instance(row_id).state == "terminating"
    assert live(world.provisioner) == []
    reconciler.run_once()
    assert APP not in {a.name for a in world.store.list_apps()}


def test_no_profile_run_starts_for_an_app_being_taken_down(
    world: World, worker: FakeV2Worker
) -> None:
    register(world, spec())
    price = default_catalog()[SMALL].price_usd_per_hr
    world.store.record_instance(  # a fleet to drain: the app is not deleted at once
        APP, request_id="r-1", instance_type=SMALL, price_usd_per_hr=price, reason="test"
    )
    assert request_teardown(world.store, APP, "tester").deleted is False
    for start in (
        lambda: profile(world),
        lambda: check_profile_run(
            world.store, world.resolver, world.provisioner, APP, ProfileRunRequest()
        ),
    ):
        with pytest.raises(ConflictError, match="is being taken down") as refused:
            start()
        assert "\n" not in str(refused.value)
    assert world.provisioner.requests == [] and len(world.store.list_instances(APP)) == 1
    # A budget set again calls the teardown off: the run goes ahead.
    world.clock.advance(1.0)
    world.store.change_budget(APP, 5.0, reason="keep it", who="tester")
    profile(world, types=(SMALL,))
    assert [r.instance_type for r in world.provisioner.requests] == [SMALL]


def test_the_api_pins_refuses_the_plan_then_profiles_the_app(
    world: World, worker: FakeV2Worker
) -> None:
    data_dir = world.data_dir / "data"
    data_dir.mkdir()
    settings = Settings(data_dir=data_dir, provisioner="fake")
    token = world.store.create_token("operator", name="op")
    world.store.add_model_version(
        "digits-small", 2, "onnx", SHA, 10, FAMILY_SIGNATURE, "file:///registry/s2.onnx"
    )
    app = create_app(
        settings,
        world.store,
        world.clock,
        resolver=world.resolver,
        provisioner=world.provisioner,
    )
    auth = {"Authorization": f"Bearer {token}"}
    with TestClient(app, raise_server_exceptions=False) as client:
        created = client.post("/v1/apps", json=spec(types=(SMALL,)), headers=auth)
        assert created.status_code == 201, created.text
        assert created.json()["spec"]["models"][0]["artifact"] == "digits-small@2"
        refused = client.post(f"/v1/apps/{APP}/plans", json={"rate_qps": 5}, headers=auth)
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["message"] == (
            "app digits has no latency profiles for model small: run heteroplane profile run"
            " --app digits"
        )
        assert client.get(f"/v1/apps/{APP}/profiles", headers=auth).status_code == 404
        # Asked first (the CLI does), a check answers what would run and starts nothing.
        checked = client.post(
            f"/v1/apps/{APP}/profiles?check=true", json={"batch_sizes": [1, 4]}, headers=auth
        )
        assert checked.status_code == 200, checked.text
        price = default_catalog()[SMALL].price_usd_per_hr
        assert checked.json() == {
            "app": APP,
            "checked": True,
            "models": ["small"],
            "instance_types": [SMALL],
            "cost_usd_per_hr": price,
            # 2 batch sizes x (5 warm-up + 20 timed) rounds x 1 model; the fake's workers are
            # no instances that boot.
            "calls_per_worker": 50,
            "local_workers": True,
        }
        bad = client.post(
            f"/v1/apps/{APP}/profiles?check=true", json={"types": [GPU]}, headers=auth
        )
        assert bad.status_code == 422 and bad.json()["error"]["field"] == "types", bad.text
        # A batch size asked for twice is refused as a type named twice is (not measured once).
        for checking in ("?check=true", ""):
            twice = client.post(
                f"/v1/apps/{APP}/profiles{checking}", json={"batch_sizes": [4, 1, 4]}, headers=auth
            )
            assert twice.status_code == 422, twice.text
            assert twice.json()["error"]["field"] == "batch_sizes", twice.text
        assert world.provisioner.requests == [] and world.store.list_instances(APP) == []
        ran = client.post(
            f"/v1/apps/{APP}/profiles",
            json={"batch_sizes": [1, 4], "samples": 2, "warmup": 0},
            headers=auth,
        )
        assert ran.status_code == 200, ran.text
        assert ran.json()["instance_types"] == [SMALL] and ran.json()["models"] == ["small"]
        (request,) = world.provisioner.requests
        assert request.artifacts[0].version == 2
        stored = client.get(f"/v1/apps/{APP}/profiles", headers=auth)
        assert stored.json()["format"] == "heteroplane.profiles/v1"
        planned = client.post(f"/v1/apps/{APP}/plans", json={"rate_qps": 5}, headers=auth)
        assert planned.status_code == 201, planned.text
        unknown = client.post(
            "/v1/apps",
            json={**spec(), "name": "other", "models": [{"name": "m", "artifact": "nope"}]},
            headers=auth,
        )
        assert unknown.status_code == 422
        assert unknown.json()["error"]["field"] == "models[0].artifact"


@contextmanager
def profiled_at_version_1(
    world: World,
) -> Iterator[tuple[TestClient, dict[str, str], dict[str, Any]]]:
    """An app of digits-small@1 (version 3 of other bytes registered) applied through the API
    and profiled once: the client, its auth header and the spec document."""
    world.store.add_model_version(
        "digits-small", 3, "torchscript", "ef" * 32, 10, FAMILY_SIGNATURE, "file:///r/s3.pt"
    )
    settings = Settings(data_dir=world.data_dir / "data", provisioner="fake")
    token = world.store.create_token("operator", name="op")
    app = create_app(
        settings, world.store, world.clock, resolver=world.resolver, provisioner=world.provisioner
    )
    auth = {"Authorization": f"Bearer {token}"}
    document = spec(types=(SMALL,))
    document["models"][0]["artifact"] = "digits-small@1"
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.post("/v1/apps", json=document, headers=auth).status_code == 201
        ran = client.post(
            f"/v1/apps/{APP}/profiles", json={"batch_sizes": [1], "samples": 2}, headers=auth
        )
        assert ran.status_code == 200, ran.text
        yield client, auth, document


def test_a_spec_that_moves_a_model_to_other_bytes_drops_the_profiles_measured_of_the_old(
    world: World, worker: FakeV2Worker
) -> None:
    """`app apply` that gives a model another artifact (no live instance: allowed) kept the
    profiles measured of the old one, and the app was planned and served on them: a model of
    other bytes (another format here) planned on another model's latencies. The profiles of
    that model go, so that the app asks to be profiled again; a version of the same bytes
    keeps them."""
    world.store.add_model_version(
        "digits-small", 2, "onnx", SHA, 10, FAMILY_SIGNATURE, "file:///registry/s2.onnx"
    )
    with profiled_at_version_1(world) as (client, auth, document):

        def replace_and_plan(artifact: str) -> Any:
            document["models"][0]["artifact"] = artifact
            replaced = client.put(f"/v1/apps/{APP}", json=document, headers=auth)
            assert replaced.status_code == 200, replaced.text
            return client.post(f"/v1/apps/{APP}/plans", json={"rate_qps": 5}, headers=auth)

        assert replace_and_plan("digits-small@2").status_code == 201  # the same bytes
        refused = replace_and_plan("digits-small@3")
        assert refused.status_code == 409, refused.text
        assert "no latency profiles for model small" in refused.json()["error"]["message"]
        kept = world.store.get_app_profiles(APP) or {}
        assert [p for p in kept.get("profiles", []) if p.get("model") == "small"] == []


def test_a_spec_whose_profiles_drop_was_not_said_is_not_replaced_either(world: World) -> None:
    """The write of the decision that says a replaced spec drops a model's profiles fails (the
    process dies there): neither the spec nor the drop is kept, and replacing it again does all
    and says it once. The spec was written first, in a transaction of its own: the old bytes'
    profiles stayed for the new ones (the replace again changed nothing), or were dropped and
    never said."""
    with profiled_at_version_1(world) as (client, auth, document):
        document["models"][0]["artifact"] = "digits-small@3"
        with decision_write_fails("latency profiles of small dropped") as failing:
            died = client.put(f"/v1/apps/{APP}", json=document, headers=auth)
            assert died.status_code == 500 and failing == [], died.text
        assert world.store.get_app(APP).spec["models"][0]["artifact"] == "digits-small@1"
        assert world.store.get_app_profiles(APP) is not None
        replaced = client.put(f"/v1/apps/{APP}", json=document, headers=auth)
        assert replaced.status_code == 200, replaced.text
    assert world.store.get_app_profiles(APP) is None
    said = world.store.list_decisions(APP, kinds=["profiles_measured"])
    assert [d.numbers.get("dropped") for d in said] == [None, True]


def test_a_run_whose_rows_are_ended_meanwhile_stops_and_leaves_no_worker(world: World) -> None:
    register(world, spec())
    launch = world.provisioner.launch

    def app_down_during_the_launch(request: LaunchRequest) -> list[ProvisionedInstance]:
        # The reconciler's teardown ends the rows between the run's record and its launch.
        for r in world.store.list_instances(APP, states=["requested"]):
            world.store.transition_instance(r.id, "failed", reason="teardown (test)")
        return launch(request)

    world.provisioner.launch = app_down_during_the_launch  # type: ignore[method-assign]
    with pytest.raises(ProfilingError, match="row was ended meanwhile"):
        profile(world, types=(SMALL,))
    assert live(world.provisioner) == []
    assert world.store.get_app_profiles(APP) is None


def record_run(world: World, run: str, instance_type: str = SMALL, who: str = "alice") -> str:
    """A row of another profile run of the app, as a run records it (the run not running)."""
    return profile_row(world, run, instance_type, f"profile run {run} by {who}").id


def test_a_second_run_while_one_is_in_progress_is_refused_and_the_first_stores_its_own(
    world: World,
) -> None:
    """Two runs of an app were both taken, and the one that ended last stored its profiles
    over the other's (a 10-sample run, started after a long run, was replaced when the long
    run finished): the second is refused, a 409 naming the run, and launches nothing."""
    register(world, spec(types=(SMALL,)))
    listed = world.provisioner.list
    waiting, go_on = threading.Event(), threading.Event()

    def held(tags: Any) -> Any:  # the first run waits here for its worker, launched already
        if PROFILE_RUN_TAG in tags:
            waiting.set()
            assert go_on.wait(30)
        return listed(tags)

    world.provisioner.list = held  # type: ignore[method-assign]
    first: list[Any] = []
    running = threading.Thread(target=lambda: first.append(profile(world, samples=5)))
    running.start()
    try:
        assert waiting.wait(30)
        world.provisioner.list = listed  # type: ignore[method-assign]
        (row,) = world.store.list_instances(APP)
        run = row.request_id.split("-")[1]
        started = row.created_at.isoformat(timespec="seconds")
        said = (
            f"app {APP!r} has a profile run in progress: run {run} by tester on {SMALL},"
            f" started {started}; wait for it to end"
        )
        with pytest.raises(ProfileRunInProgressError) as refused:
            profile(world, samples=2)
        assert str(refused.value) == said and isinstance(refused.value, ConflictError)  # 409
        with pytest.raises(ProfileRunInProgressError, match=f"run {run} by tester"):
            check_profile_run(
                world.store, world.resolver, world.provisioner, APP,
                ProfileRunRequest(batch_sizes=(1,)), clock=world.clock,
            )  # fmt: skip
        # The refused run's rows end unlaunched, saying why.
        (second,) = [r for r in world.store.list_instances(APP) if r.id != row.id]
        assert second.state == "failed" and second.provider_id is None
        events = world.store.list_instance_events(instance_id=second.id)
        assert events[-1].reason == f"not launched: {said}"
        assert len(world.provisioner.requests) == 1
    finally:
        go_on.set()
        running.join()
    (result,) = first
    assert world.store.get_app_profiles(APP) == dict(result.document)
    assert result.samples == 5
    # Over: the app is free again.
    again = profile(world, samples=2)
    assert world.store.get_app_profiles(APP) == dict(again.document)


def test_a_run_whose_app_is_taken_down_as_it_measures_stores_nothing_and_says_so(
    world: World, worker: FakeV2Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`app down` while the run measured: the run went on to say "profiles stored ... plan it
    with" of an app about to be deleted (a tester). It is a conflict saying so, nothing stored."""
    from controlplane.apps import profile_run

    register(world, spec())

    def taken_down(name: str) -> None:
        if name == "profile_run.measuring":
            assert request_teardown(world.store, APP, "tester").deleted is False

    monkeypatch.setattr(profile_run, "crash_point", taken_down)
    with pytest.raises(ProfilingInterruptedError) as caught:
        profile(world, types=(SMALL,))
    assert str(caught.value).startswith(
        f"profile run of {APP} stopped: app {APP!r} is being taken down (heteroplane app down):"
        " nothing measured is stored"
    )
    assert "\n" not in str(caught.value)
    assert world.store.get_app_profiles(APP) is None
    assert live(world.provisioner) == []


def test_two_runs_recorded_at_once_are_never_both_taken(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each run records its rows, then looks for another (as the budget check does): another
    run recorded after ours, before our look, finds ours in its own look, and ours finds it:
    both are refused, never both taken."""
    from controlplane.apps import profile_run

    register(world, spec(types=(SMALL,)))
    its_look: list[str] = []

    def another_records(name: str) -> None:
        if name != "profile_run.after_row":
            return
        other = world.store.get_instance(record_run(world, "beefcafe"))
        with pytest.raises(ProfileRunInProgressError) as refused:
            profile_run._refuse_a_second_run(world.store, APP, world.clock.utcnow(), 10.0, [other])
        its_look.append(refused.value.run)

    monkeypatch.setattr(profile_run, "crash_point", another_records)
    with pytest.raises(ProfileRunInProgressError, match="run beefcafe by alice"):
        profile(world)
    (ours,) = [r for r in world.store.list_instances(APP) if "beefcafe" not in r.request_id]
    assert its_look == [ours.request_id.split("-")[1]]
    assert ours.state == "failed" and world.provisioner.requests == []


def test_a_run_that_died_with_its_replica_holds_the_app_for_a_few_heartbeats_at_most(
    world: World,
) -> None:
    """The service restarted mid-run: its rows stay kept until the reconciler reaps them. The
    app is refused another run while they beat, and free once they stopped beating for
    RUN_GONE_BEATS heartbeats, reaped or not."""
    from controlplane.apps.profile_run import DEFAULT_HEARTBEAT_S, RUN_GONE_BEATS

    register(world, spec(types=(SMALL,)))
    dead = record_run(world, "0badf00d", who="bob")
    with pytest.raises(ProfileRunInProgressError, match="run 0badf00d by bob"):
        profile(world)
    world.clock.advance(RUN_GONE_BEATS * DEFAULT_HEARTBEAT_S - 1)
    with pytest.raises(ProfileRunInProgressError):
        profile(world)
    world.clock.advance(2)
    result = profile(world)
    assert world.store.get_app_profiles(APP) == dict(result.document)
    assert world.store.get_instance(dead).state == "requested"  # not reaped yet: no matter
    # A rollout's workers (its timing stores nothing) hold no profile run back.
    world.store.record_instance(
        APP,
        request_id=f"profile:rollout-{APP}-7-t6kdc0-{SMALL}-1",
        instance_type=SMALL,
        price_usd_per_hr=default_catalog()[SMALL].price_usd_per_hr,
    )
    profile(world)


def test_a_batch_the_current_profile_says_outlasts_a_call_is_refused_before_any_worker(
    world: World,
) -> None:
    """``profile run --batch-sizes 4096`` started a worker and waited out the call's timeout
    (the batch takes about 123 s): where the app's profile says a batch takes longer than a
    call may, the check (and the run) refuse it first, naming the prediction."""
    from controlplane.apps.profiler import CALL_TIMEOUT_S
    from estimator.profiles import LatencyProfile, profiles_document

    register(world, spec(types=(SMALL,)))
    first = profile(world, batch_sizes=(1, 64))
    # A profile of about 3 + 30 ms a row on SMALL: 4,096 rows take about 123 s.
    cells = (np.array([33.0]), np.array([1923.0]))
    slow = LatencyProfile("small", SMALL, np.array([1, 64]), cells)
    world.store.put_app_profiles(
        APP, {**dict(first.document), "profiles": profiles_document([slow])["profiles"]}
    )
    world.resolver.invalidate(APP)
    said = (
        f"batch_sizes: a batch of 4096 of small on {SMALL} takes about 123 s by the app's"
        f" current profile, extrapolated from batches up to 64, past the {CALL_TIMEOUT_S:g} s"
        " a worker call may take: profile smaller batch sizes (--batch-sizes)"
    )
    request = ProfileRunRequest(batch_sizes=(1024, 4096))
    with pytest.raises(ProfilingRequestError) as checked:
        check_profile_run(world.store, world.resolver, world.provisioner, APP, request)
    assert str(checked.value) == said
    launched = len(world.provisioner.requests)
    with pytest.raises(ProfilingRequestError, match="a batch of 4096 of small"):
        profile(world, batch_sizes=(1024, 4096))
    assert len(world.provisioner.requests) == launched
    # 1,024 rows, about 31 s, are measured.
    check_profile_run(
        world.store, world.resolver, world.provisioner, APP, ProfileRunRequest(batch_sizes=(1024,))
    )


def test_a_check_says_how_many_calls_each_worker_answers_and_whether_it_boots(
    world: World,
) -> None:
    """``profile run`` said "this takes minutes" of a run of seconds on the local provisioner:
    the check says whether the workers are local processes and how many calls each answers."""
    register(world, spec(types=(SMALL,)))
    request = ProfileRunRequest(batch_sizes=(1, 4, 16), samples=3, warmup=1)
    local = check_profile_run(world.store, world.resolver, world.provisioner, APP, request)
    assert (local.calls_per_worker, local.local_workers) == (3 * (1 + 3), True)
    world.provisioner.name = "ec2"
    booted = check_profile_run(world.store, world.resolver, world.provisioner, APP, request)
    assert (booted.calls_per_worker, booted.local_workers) == (12, False)
    assert booted.to_json()["local_workers"] is False


def test_the_api_answers_a_second_run_409_naming_the_one_in_progress(world: World) -> None:
    """What ``heteroplane profile run`` asks first (``?check=true``) and the run itself."""
    data_dir = world.data_dir / "data"
    data_dir.mkdir()
    settings = Settings(data_dir=data_dir, provisioner="fake")
    token = world.store.create_token("operator", name="op")
    app = create_app(
        settings, world.store, world.clock, resolver=world.resolver, provisioner=world.provisioner
    )
    auth = {"Authorization": f"Bearer {token}"}
    register(world, spec(types=(SMALL,)))
    record_run(world, "0badf00d", who="bob")
    with TestClient(app, raise_server_exceptions=False) as client:
        for checking in ("?check=true", ""):
            refused = client.post(
                f"/v1/apps/{APP}/profiles{checking}", json={"batch_sizes": [1]}, headers=auth
            )
            assert refused.status_code == 409, refused.text
            message = refused.json()["error"]["message"]
            assert (
                message.startswith(
                    f"app {APP!r} has a profile run in progress: run 0badf00d by bob on {SMALL},"
                )
                and "\n" not in message
            )
    assert world.provisioner.requests == []
