"""The REST API through FastAPI's TestClient, on a real SQLite file migrated through the real
migrations, with tokens made by the store and a fake clock.

Every route's happy path; 401 against 403; bad input of every kind is a 4xx with the error body,
never a 5xx (including junk thrown by hypothesis); concurrent plan applies and budget changes;
and the OpenAPI document declares every error response.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from controlplane.clock import FAKE_EPOCH, FakeClock
from controlplane.db.store import Store
from controlplane.errors import InvalidValueError
from controlplane.loops.scheduler import GuardedJob, JobBodies, JobSchedule, Scheduler
from controlplane.service.app import create_app
from controlplane.settings import Settings
from tests.dying_writes import decision_write_fails

# Sub-linear in the batch size, as in tests/unit/test_planner.py: planning takes milliseconds.
SHAPES = {"g4dn.xlarge": (3.0, 1.0), "r5n.large": (8.0, 4.0), "t3.xlarge": (12.0, 6.0)}
BATCHES = (1, 2, 4, 8, 16)
SCOPES = ("admin", "operator", "viewer", "infer")


def write_profiles(folder: Path) -> Path:
    rows = ["model,instance_type,batch_size,sample,infer_ms,load_ms"]
    for itype, (fixed, slope) in SHAPES.items():
        for b in BATCHES:
            rows += [
                f"m,{itype},{b},{i},{(fixed + slope * b) * (0.9 + 0.02 * i):.4f},0"
                for i in range(11)
            ]
    path = folder / "profiles.csv"
    path.write_text("\n".join(rows) + "\n")
    return path


def spec(name: str = "toy", budget: float = 4.0, latency_ms: float = 40.0) -> dict[str, Any]:
    return {
        "name": name,
        "models": [{"name": "m", "profiles": "profiles.csv"}],
        "slo": {"latency_ms": latency_ms},
        "budget_usd_per_hr": budget,
        "instance_types": ["g4dn.xlarge", "r5n.large", "t3.xlarge"],
    }


@dataclass
class Api:
    client: TestClient
    store: Store
    clock: FakeClock
    tokens: dict[str, str]
    data_dir: Path

    def auth(self, scope: str = "admin") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[scope]}"}

    def call(
        self, method: str, url: str, scope: str | None = "admin", **kwargs: Any
    ) -> httpx.Response:
        headers = {**(self.auth(scope) if scope else {}), **kwargs.pop("headers", {})}
        response: httpx.Response = self.client.request(method, url, headers=headers, **kwargs)
        return response

    def register(self, **overrides: Any) -> dict[str, Any]:
        response = self.call("POST", "/v1/apps", "operator", json={**spec(), **overrides})
        assert response.status_code == 201, response.text
        body: dict[str, Any] = response.json()
        return body

    def preview(self, app: str = "toy", **body: Any) -> dict[str, Any]:
        response = self.call(
            "POST", f"/v1/apps/{app}/plans", "operator", json=body or {"rate_qps": 100.0}
        )
        assert response.status_code == 201, response.text
        plan: dict[str, Any] = response.json()
        return plan


def service_parts(tmp_path: Path) -> tuple[Path, Settings, FakeClock, Store]:
    """A data folder under ``tmp_path`` with the toy profiles, the fake provisioner's settings
    on it, a fake clock and the store, migrated: what an API test's app is made of."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    write_profiles(data_dir)
    settings_ = Settings(data_dir=data_dir, provisioner="fake")
    clock = FakeClock()
    return data_dir, settings_, clock, Store.from_url(settings_.database_url, clock, upgrade=True)


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    data_dir, settings_, clock, store = service_parts(tmp_path)
    tokens = {scope: store.create_token(scope, name=f"{scope}-token") for scope in SCOPES}
    app = create_app(settings_, store, clock)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield Api(client, store, clock, tokens, data_dir)
    store.close()


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error: dict[str, Any] = body["error"]
    assert set(error) == {"code", "message", "field"}
    assert error["message"] and "\n" not in error["message"]
    if code is not None:
        assert error["code"] == code, error
    return error


# --- health and metrics ----------------------------------------------------------------------


def test_healthz_needs_no_token(api: Api) -> None:
    response = api.client.get("/healthz")
    assert response.status_code == 200
    assert response.json()["status"] == "ok"


def scrape(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """The samples of an exposition, by (name, labels), as Prometheus parses them."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def sample(text: str, name: str, **labels: str) -> float | None:
    return scrape(text).get((name, frozenset(labels.items())))


def test_metrics_in_prometheus_text(api: Api) -> None:
    api.register()
    api.store.record_instance(
        "toy",
        request_id="r1",
        instance_type="g4dn.xlarge",
        price_usd_per_hr=0.526,
        state="running",
    )
    api.call("GET", "/v1/apps/nope")  # a 404, counted under no app
    # A 403 is answered before the app is looked up: any name a viewer makes up would be a
    # new label (a tester's sweep), so it is counted under no app too.
    forbidden = api.call("POST", "/v1/apps/zzc322697d/infer", "viewer", json={"inputs": [[0]]})
    assert forbidden.status_code == 403
    api.call("GET", "/v1/apps/toy/fleet", "viewer")
    response = api.call("GET", "/metrics", "viewer")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = response.text
    assert "# TYPE heteroplane_app_budget_usd_per_hr gauge" in text
    assert "# TYPE heteroplane_api_requests_total counter" in text
    assert "# TYPE heteroplane_scheduler_job_runs_total counter" in text  # no scheduler: no runs
    assert sample(text, "heteroplane_app_budget_usd_per_hr", app="toy") == 4.0
    assert sample(text, "heteroplane_app_fleet_cost_usd_per_hr", app="toy") == 0.526
    assert sample(text, "heteroplane_app_instances", app="toy", state="running") == 1.0
    assert sample(text, "heteroplane_app_instances", app="toy", state="pending") == 0.0
    assert sample(text, "heteroplane_app_arrival_rate_qps", app="toy") is None  # no sample yet
    assert sample(text, "heteroplane_api_requests_total", app="toy", status="200") == 1.0
    assert sample(text, "heteroplane_api_requests_total", app="", status="404") == 1.0
    assert sample(text, "heteroplane_api_requests_total", app="", status="403") == 1.0
    assert 'app="zzc322697d"' not in text
    # Read at scrape time: the scrape above is counted in the next one.
    again = api.call("GET", "/metrics", "viewer").text
    assert sample(again, "heteroplane_api_requests_total", app="", status="200") == 1.0
    assert_error(api.call("GET", "/metrics", None), 401, "unauthorized")
    assert_error(api.call("GET", "/metrics", "infer"), 403, "forbidden")


def test_every_view_costs_a_spot_instance_at_its_price_now(api: Api) -> None:
    """The reconciler recorded a spot instance's price now (its type's spot price moved since
    the launch): the fleet route, the budget's, /metrics and the instance list read it."""
    api.register()
    store = api.store
    spot = store.record_instance(
        "toy",
        request_id="r1",
        instance_type="g4dn.xlarge",
        price_usd_per_hr=0.2,
        state="running",
        market="spot",
    )
    store.record_instance(
        "toy", request_id="r2", instance_type="g4dn.xlarge", price_usd_per_hr=0.526, state="running"
    )
    store.set_prices_now([spot.id], 0.3)
    fleet = api.call("GET", "/v1/apps/toy/fleet", "viewer").json()
    assert fleet["cost_usd_per_hr"] == pytest.approx(0.826)
    assert fleet["by_type"][0]["price_usd_per_hr"] == pytest.approx(0.413)
    budget = api.call("GET", "/v1/apps/toy/budget", "viewer").json()
    assert budget["fleet_cost_usd_per_hr"] == pytest.approx(0.826)
    text = api.call("GET", "/metrics", "viewer").text
    assert sample(text, "heteroplane_app_fleet_cost_usd_per_hr", app="toy") == pytest.approx(0.826)
    listed = {i["id"]: i for i in api.call("GET", "/v1/instances?app=toy", "viewer").json()}
    assert (listed[spot.id]["price_usd_per_hr"], listed[spot.id]["price_now_usd_per_hr"]) == (
        0.2,
        0.3,
    )
    assert all(i["price_now_usd_per_hr"] is None for k, i in listed.items() if k != spot.id)


def test_metrics_of_two_apps_in_one_process_are_their_own(api: Api, tmp_path: Path) -> None:
    """Each FastAPI app has its own registry: a second service in the process neither clashes
    with the first nor sees its apps, requests or jobs."""
    api.register()
    runs: list[str] = []
    scheduler = Scheduler([JobSchedule("rollup", lambda: runs.append("rollup"), 3600.0)])
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    other_settings = Settings(data_dir=other_dir, provisioner="fake")
    other_store = Store.from_url(other_settings.database_url, api.clock, upgrade=True)
    token = other_store.create_token("viewer", name="viewer-token")
    other = create_app(other_settings, other_store, api.clock, scheduler)
    try:
        with TestClient(other) as client:
            scheduler.jobs["rollup"]()
            headers = {"Authorization": f"Bearer {token}"}
            first = client.get("/metrics", headers=headers).text
            ours = api.call("GET", "/metrics", "viewer").text
            second = client.get("/metrics", headers=headers).text
    finally:
        other_store.close()
    assert runs == ["rollup"]
    assert sample(first, "heteroplane_scheduler_job_runs_total", job="rollup", outcome="ran") == 1
    assert sample(first, "heteroplane_app_budget_usd_per_hr", app="toy") is None
    assert sample(ours, "heteroplane_app_budget_usd_per_hr", app="toy") == 4.0
    assert not any(name == "heteroplane_scheduler_job_runs_total" for name, _ in scrape(ours))
    assert sample(second, "heteroplane_api_requests_total", app="", status="200") == 1.0


# --- apps ------------------------------------------------------------------------------------


def test_app_lifecycle(api: Api) -> None:
    created = api.register()
    assert created["name"] == "toy"
    assert created["budget_usd_per_hr"] == 4.0
    assert created["version"] == 1
    # The relative profiles path is anchored in the service's data directory.
    assert created["spec"]["models"][0]["profiles"] == str(api.data_dir / "profiles.csv")

    listed = api.call("GET", "/v1/apps", "viewer").json()
    assert [app["name"] for app in listed] == ["toy"]
    assert api.call("GET", "/v1/apps/toy", "viewer").json() == created

    replaced = api.call("PUT", "/v1/apps/toy", "operator", json=spec(latency_ms=60.0, budget=5.0))
    assert replaced.status_code == 200, replaced.text
    assert replaced.json()["spec"]["slo"]["latency_ms"] == 60.0
    assert replaced.json()["budget_usd_per_hr"] == 5.0
    assert replaced.json()["version"] == 2
    changes = api.call("GET", "/v1/apps/toy/budget", "viewer").json()["changes"]
    assert [(c["old_usd_per_hr"], c["new_usd_per_hr"]) for c in changes] == [
        (None, 4.0),
        (4.0, 5.0),
    ]
    # A spec that hands the scaling to another loop says so (what a new leader's loop reads).
    assert not [d for d in api.store.list_decisions("toy") if d.kind == "scaling_switched"]
    switched = {**spec(latency_ms=60.0, budget=5.0), "scaling": "infaas"}
    assert api.call("PUT", "/v1/apps/toy", "operator", json=switched).status_code == 200
    (decision,) = [d for d in api.store.list_decisions("toy") if d.kind == "scaling_switched"]
    assert decision.numbers == {"from": "inferline", "to": "infaas"}

    assert_error(api.call("DELETE", "/v1/apps/toy", "operator"), 403, "forbidden")
    assert api.call("DELETE", "/v1/apps/toy", "admin").status_code == 204
    assert_error(api.call("GET", "/v1/apps/toy"), 404, "not_found")


def test_a_spec_that_leaves_out_a_type_the_app_runs_is_a_conflict(api: Api) -> None:
    # Applied, the plan went on asking for the type while serving no longer had it (every query
    # a 503 until a new plan) and rollouts could not price it (a 500).
    api.register()
    document = {
        "feasible": True,
        "cost_usd_per_hr": 0.526,
        "stages": [{"name": "m", "fleet": {"g4dn.xlarge": 1}, "batch_size": 1}],
    }
    plan = api.store.create_plan("toy", document)
    api.store.apply_plan("toy", plan.id)
    api.store.record_instance(
        "toy", request_id="r1", instance_type="t3.xlarge", price_usd_per_hr=0.1664
    )
    before = api.call("GET", "/v1/apps/toy").json()
    narrower = {**spec(), "instance_types": ["r5n.large"]}
    error = assert_error(api.call("PUT", "/v1/apps/toy", json=narrower), 409, "conflict")
    assert error["field"] == "instance_types"
    message = error["message"]
    assert "runs g4dn.xlarge, t3.xlarge" in message and f"applied plan {plan.id}" in message
    assert (
        "1 live instance(s)" in message and "max_counts {g4dn.xlarge: 0, t3.xlarge: 0}" in message
    )
    assert api.call("GET", "/v1/apps/toy").json() == before  # nothing stored
    # Kept listed with a cap of 0 (the way off it), the spec is taken.
    capped = {**spec(), "max_counts": {"g4dn.xlarge": 0, "t3.xlarge": 0}}
    assert api.call("PUT", "/v1/apps/toy", json=capped).status_code == 200
    # A type nothing runs can go (one of those left uncapped: capped all at 0, the app could
    # run nothing, a 422).
    fewer = {
        **capped,
        "instance_types": ["g4dn.xlarge", "t3.xlarge"],
        "max_counts": {"g4dn.xlarge": 0},
    }
    assert api.call("PUT", "/v1/apps/toy", json=fewer).status_code == 200


def test_registering_a_name_twice_is_a_conflict(api: Api) -> None:
    api.register()
    error = assert_error(api.call("POST", "/v1/apps", json=spec()), 409, "app_exists")
    assert error["field"] == "name"


def test_deleting_an_app_with_live_instances_needs_force(api: Api) -> None:
    api.register()
    api.store.record_instance(
        "toy", request_id="r1", instance_type="t3.xlarge", price_usd_per_hr=0.1664
    )
    assert_error(api.call("DELETE", "/v1/apps/toy"), 409, "conflict")
    assert api.call("DELETE", "/v1/apps/toy?force=true").status_code == 204


@pytest.mark.parametrize(
    ("document", "field"),
    [
        ({**spec(), "instance_types": ["x9.huge"]}, "instance_types[0]"),
        ({**spec(), "slo": {"latency_ms": -1}}, "slo.latency_ms"),
        ({**spec(), "slo": {"latency_ms": "fast"}}, "slo.latency_ms"),
        ({**spec(), "budget_usd_per_hr": 0.01}, "budget_usd_per_hr"),
        ({**spec(), "budget_usd_per_hr": -4}, "budget_usd_per_hr"),
        ({**spec(), "colour": "blue"}, "colour"),
        ({**spec(), "name": "Not A Name"}, "name"),
        ({**spec(), "models": [{"name": "zz", "profiles": "profiles.csv"}]}, "models[0].name"),
        ({**spec(), "models": [{"name": "m", "profiles": "missing.csv"}]}, "models[0].profiles"),
        ({**spec(), "models": [{"name": "m", "profiles": "/etc"}]}, "models[0].profiles"),
        ({k: v for k, v in spec().items() if k != "slo"}, "slo"),
    ],
)
def test_an_invalid_spec_is_a_422_naming_the_field(
    api: Api, document: dict[str, Any], field: str
) -> None:
    error = assert_error(api.call("POST", "/v1/apps", json=document), 422, "invalid_spec")
    assert error["field"] == field
    assert field.split("[")[0].split(".")[0] in error["message"]


def test_a_binary_profile_file_is_a_422(api: Api) -> None:
    (api.data_dir / "junk.csv").write_bytes(bytes(range(256)) * 8)
    document = {**spec(), "models": [{"name": "m", "profiles": "junk.csv"}]}
    error = assert_error(api.call("POST", "/v1/apps", json=document), 422)
    assert error["field"] == "models[0].profiles"


def test_a_candidate_type_the_profiles_lack_is_named(api: Api) -> None:
    """The profile file reads; it has no samples for one of the spec's types: the error says
    which (names the spec gave), not that the file cannot be read."""
    document = {**spec(), "instance_types": ["g4dn.xlarge", "c5.xlarge"]}
    error = assert_error(api.call("POST", "/v1/apps", json=document), 422, "invalid_spec")
    assert error["field"] == "models[0].profiles"
    assert "missing profile for candidate type 'c5.xlarge' of model 'm'" in error["message"]
    assert "cannot be read" not in error["message"]


@pytest.mark.parametrize("field", ["catalog", "profiles"])
def test_a_spec_error_never_shows_what_a_server_file_holds(api: Api, field: str) -> None:
    secret = api.data_dir / "secret.txt"
    secret.write_text("AWS_SECRET_ACCESS_KEY=hunter2,more\nline two\n")
    document = spec()
    if field == "catalog":
        document["catalog"] = str(secret)
    else:
        document["models"] = [{"name": "m", "profiles": str(secret)}]
    error = assert_error(api.call("POST", "/v1/apps", json=document), 422, "invalid_spec")
    assert "hunter2" not in error["message"] and "AWS_" not in error["message"]
    assert str(secret) in error["message"]
    assert error["field"] == ("catalog" if field == "catalog" else "models[0].profiles")


@pytest.mark.parametrize("field", ["catalog", "validation", "profiles"])
def test_spec_files_outside_the_data_directory_get_one_message(
    api: Api, tmp_path: Path, field: str
) -> None:
    """A path that leaves the data directory (absolute, ``..``, a link) is refused with the
    same message but for the path whether or not a file is there: the answer tells nothing of the
    host. It names the path, how a relative one was taken, and the data directory."""
    outside = tmp_path / "outside.csv"
    outside.write_text((api.data_dir / "profiles.csv").read_text())
    (api.data_dir / "link.csv").symlink_to(outside)
    data_dir = api.data_dir.resolve()
    messages = set()
    for path in (str(outside), "/etc/passwd", "/no/such/file.csv", "../outside.csv", "link.csv"):
        document = spec()
        if field == "profiles":
            document["models"] = [{"name": "m", "profiles": path}]
        elif field == "validation":  # a cascade's
            document["models"] = [{"name": n, "profiles": "profiles.csv"} for n in ("m", "n")]
            document |= {"cascade": ["m", "n"], "thresholds": [0.5], "validation": path}
        else:
            document[field] = path
        error = assert_error(api.call("POST", "/v1/apps", json=document), 422, "invalid_spec")
        assert error["field"] == ("models[0].profiles" if field == "profiles" else field)
        shown = path if path.startswith("/") else f"{path}, taken as {data_dir / path}"
        if path.startswith(".."):
            shown = f"{path}, taken as {data_dir.parent / 'outside.csv'}"
        assert f"; {shown} is outside it" in error["message"]
        messages.add(error["message"].replace(shown, "PATH"))
    assert len(messages) == 1, messages
    message = messages.pop()
    assert f"data directory, {data_dir};" in message and "absolute path there" in message
    assert message.endswith("beside the spec file)")  # not cut by the API's 500 characters


@pytest.mark.parametrize(
    ("content_type", "named"),
    [(None, "has no Content-Type"), ("text/plain", "Content-Type is 'text/plain'")],
)
def test_a_json_body_without_the_json_content_type_says_so(
    api: Api, content_type: str | None, named: str
) -> None:
    headers = {} if content_type is None else {"Content-Type": content_type}
    response = api.call("POST", "/v1/apps", content=json.dumps(spec()), headers=headers)
    error = assert_error(response, 422, "invalid_request")
    assert "Content-Type: application/json" in error["message"] and named in error["message"]


def test_put_must_keep_the_name_and_the_app_must_exist(api: Api) -> None:
    api.register()
    error = assert_error(api.call("PUT", "/v1/apps/toy", json=spec(name="other")), 422)
    assert error["field"] == "name"
    assert_error(api.call("PUT", "/v1/apps/ghost", json=spec(name="ghost")), 404, "not_found")


@pytest.mark.parametrize(
    ("method", "url"),
    [
        ("GET", "/v1/apps/ghost"),
        ("PUT", "/v1/apps/ghost/budget"),
        ("GET", "/v1/apps/ghost/budget"),
        ("POST", "/v1/apps/ghost/plans"),
        ("GET", "/v1/apps/ghost/plans"),
        ("GET", "/v1/apps/ghost/plans/1"),
        ("POST", "/v1/apps/ghost/plans/1/apply"),
        ("GET", "/v1/apps/ghost/fleet"),
        ("GET", "/v1/apps/ghost/decisions"),
        ("GET", "/v1/apps/ghost/events"),
        ("GET", "/v1/apps/ghost/metrics"),
        ("GET", "/v1/instances?app=ghost"),
        ("DELETE", "/v1/apps/ghost"),
    ],
)
def test_an_unknown_app_is_a_404(api: Api, method: str, url: str) -> None:
    bodies = {"/v1/apps/ghost/budget": {"budget_usd_per_hr": 3.0, "reason": "r"}}
    body = bodies.get(url, {"rate_qps": 10.0} if url.endswith("/plans") else None)
    error = assert_error(api.call(method, url, json=body), 404, "not_found")
    assert "ghost" in error["message"]


def test_a_value_the_store_refuses_is_a_422(api: Api) -> None:
    api.register()

    # The planner's document may hold a value the store refuses; here, one forced through.
    def refuse(*_args: Any, **_kwargs: Any) -> None:
        raise InvalidValueError("document", "must be a JSON object without NaN")

    api.store.create_plan = refuse  # type: ignore[method-assign]
    error = assert_error(api.call("POST", "/v1/apps/toy/plans", json={"rate_qps": 50.0}), 422)
    assert error["code"] == "invalid_value" and error["field"] == "document"


def test_an_unexpected_error_is_a_generic_500_and_logged(
    api: Api, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*_args: Any, **_kwargs: Any) -> None:
        raise RuntimeError("secret internals")

    api.store.list_apps = broken  # type: ignore[method-assign]
    response = api.call("GET", "/v1/apps")
    error = assert_error(response, 500, "internal")
    assert "secret" not in error["message"]
    assert any("secret internals" in str(r.exc_info[1]) for r in caplog.records if r.exc_info)


def test_an_unknown_route_is_a_json_404(api: Api) -> None:
    assert_error(api.call("GET", "/v1/nothing-here"), 404, "not_found")
    assert_error(api.call("PATCH", "/v1/apps"), 405, "method_not_allowed")


# --- auth ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "header",
    [None, "Bearer", "Bearer ", "Basic dXNlcjpwYXNz", "hp_abc", "Bearer hp_not-a-real-token", "x"],
)
def test_missing_malformed_or_unknown_tokens_are_401_with_a_challenge(
    api: Api, header: str | None
) -> None:
    headers = {} if header is None else {"Authorization": header}
    response = api.client.get("/v1/apps", headers=headers)
    assert_error(response, 401, "unauthorized")
    assert response.headers["www-authenticate"] == "Bearer"


def test_a_revoked_token_is_401(api: Api) -> None:
    api.store.revoke_token("viewer-token")
    assert_error(api.call("GET", "/v1/apps", "viewer"), 401, "unauthorized")


@pytest.mark.parametrize(
    ("method", "url", "allowed"),
    [
        ("GET", "/v1/apps", {"admin", "operator", "viewer"}),
        ("POST", "/v1/apps", {"admin", "operator"}),
        ("PUT", "/v1/apps/toy/budget", {"admin", "operator"}),
        ("DELETE", "/v1/apps/toy", {"admin"}),
        ("GET", "/metrics", {"admin", "operator", "viewer"}),
    ],
)
def test_a_known_token_without_the_scope_is_403(
    api: Api, method: str, url: str, allowed: set[str]
) -> None:
    for scope in set(SCOPES) - allowed:
        error = assert_error(api.call(method, url, scope, json={}), 403, "forbidden")
        assert scope in error["message"]


# The dashboard's pages that hold no data: the sign-in form, signing in and out, the assets.
DASHBOARD_PUBLIC = (
    "/dashboard",
    "/dashboard/login",
    "/dashboard/logout",
    "/dashboard/static/{name}",
)


def test_every_route_but_healthz_needs_a_token(api: Api) -> None:
    for route in api.client.app.routes:  # type: ignore[attr-defined]
        path = getattr(route, "path", "")
        if path in ("/healthz", "/openapi.json", "/docs", "/docs/oauth2-redirect"):
            continue
        if path in DASHBOARD_PUBLIC:
            continue  # the sign-in form and its assets (tests/component/test_dashboard.py)
        url = path.replace("{app}", "toy").replace("{plan_id}", "1")
        for method in getattr(route, "methods", set()) - {"HEAD", "OPTIONS"}:
            response = api.client.request(method, url)
            assert response.status_code == 401, (method, url, response.text)


# --- bad input -------------------------------------------------------------------------------


def test_malformed_json_is_a_400(api: Api) -> None:
    api.register()
    for method, url in [
        ("POST", "/v1/apps"),
        ("PUT", "/v1/apps/toy"),
        ("PUT", "/v1/apps/toy/budget"),
        ("POST", "/v1/apps/toy/plans"),
    ]:
        response = api.call(
            method, url, content=b'{"name": "toy",', headers={"Content-Type": "application/json"}
        )
        assert_error(response, 400, "malformed_json")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"budget_usd_per_hr": -1, "reason": "cut"}, "budget_usd_per_hr"),
        ({"budget_usd_per_hr": 0, "reason": "cut"}, "budget_usd_per_hr"),
        ({"budget_usd_per_hr": 1e-12, "reason": "cut"}, "budget_usd_per_hr"),
        ({"budget_usd_per_hr": 1e300, "reason": "cut"}, "budget_usd_per_hr"),
        ({"budget_usd_per_hr": "3", "reason": "cut"}, "budget_usd_per_hr"),
        ({"budget_usd_per_hr": 3, "reason": ""}, "reason"),
        ({"budget_usd_per_hr": 3}, "reason"),
        ({"budget_usd_per_hr": 3, "reason": "x", "extra": 1}, "extra"),
        ({"budget_usd_per_hr": 3, "reason": "x" * 501}, "reason"),
        ({"budget_usd_per_hr": 3, "reason": "a\x00b"}, "reason"),
        # One line: a newline split budget get's audit table, an escape reached the terminal.
        ({"budget_usd_per_hr": 3, "reason": "line1\nline2"}, "reason"),
        ({"budget_usd_per_hr": 3, "reason": "a\tb"}, "reason"),
        ({"budget_usd_per_hr": 3, "reason": "\x1b[31mred"}, "reason"),
        ({"budget_usd_per_hr": 3, "reason": "\x9b31mred"}, "reason"),
    ],
)
def test_a_bad_budget_is_a_422_naming_the_field(api: Api, body: dict[str, Any], field: str) -> None:
    api.register()
    error = assert_error(api.call("PUT", "/v1/apps/toy/budget", json=body), 422, "invalid_request")
    assert error["field"] == field


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
def test_non_finite_numbers_are_refused(api: Api, literal: bytes) -> None:
    api.register()
    body = b'{"budget_usd_per_hr": ' + literal + b', "reason": "x"}'
    response = api.call(
        "PUT", "/v1/apps/toy/budget", content=body, headers={"Content-Type": "application/json"}
    )
    assert 400 <= response.status_code < 500, response.text
    assert api.call("GET", "/v1/apps/toy").json()["budget_usd_per_hr"] == 4.0


@pytest.mark.parametrize("path", ["/v1/apps/toy/infer", "/v1/apps/toy/budget"])
def test_a_compressed_body_is_said_to_be_compressed(api: Api, path: str) -> None:
    """It was answered as JSON that was not UTF-8 (a tester's gzip body); /v2 said it already."""
    import gzip

    api.register()
    method = "POST" if path.endswith("infer") else "PUT"
    body = gzip.compress(b'{"inputs": [[1, 2, 3, 4]]}')
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    response = api.call(method, path, content=body, headers=headers)
    error = assert_error(response, 400, "malformed_json")
    assert error["message"] == (
        "compressed request bodies are not served (Content-Encoding: gzip): send the body as it is"
    )


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"rate_qps": -5}, "rate_qps"),
        ({"rate_qps": 1e9}, "rate_qps"),
        ({"rate_qps": "fast"}, "rate_qps"),
        ({"rate": 5}, "rate"),
        ({"trace": {"rate_qps": 10, "kind": "uniform"}}, "trace.kind"),
        ({"trace": {"rate_qps": 10, "cv2": 4}}, "trace"),
        # A gamma trace names its cv2 (it was planned as Poisson, under the name gamma).
        ({"trace": {"rate_qps": 10, "kind": "gamma"}}, "trace"),
        ({"trace": {"rate_qps": 1e4, "duration_s": 1e5}}, "trace"),
        ({"trace": {"rate_qps": 10, "batch_dist": "zipf"}}, "trace.batch_dist"),
        (
            {"trace": {"rate_qps": 10, "batch_dist": "fixed:99999999999999999999"}},
            "trace.batch_dist",
        ),
        ({"trace": {"rate_qps": 10, "batch_dist": "fixed:100"}}, None),
        ({"trace": {"rate_qps": 10}, "rate_qps": 10}, None),
        ({"seed": -1, "rate_qps": 10}, "seed"),
        ({}, "rate_qps"),
    ],
)
def test_a_bad_plan_request_is_a_422(api: Api, body: dict[str, Any], field: str | None) -> None:
    api.register()
    error = assert_error(api.call("POST", "/v1/apps/toy/plans", json=body), 422)
    assert error["field"] == field


def test_a_plan_request_with_no_body_needs_a_rate(api: Api) -> None:
    api.register()
    error = assert_error(api.call("POST", "/v1/apps/toy/plans"), 422)
    assert error["field"] == "rate_qps"


@pytest.mark.parametrize(
    "url",
    [
        "/v1/apps/Bad_Name",
        "/v1/apps/toy/plans/0",
        "/v1/apps/toy/plans/99999999999999999999999",
        "/v1/apps/toy/plans/abc",
        "/v1/apps/toy/decisions?since=yesterday",
        "/v1/apps/toy/decisions?since=20261202",  # not Unix seconds: ISO 8601 only
        "/v1/apps/toy/metrics?until=-1",
        "/v1/apps/toy/metrics?since=1764615634.5",
        "/v1/apps/toy/decisions?limit=0",
        "/v1/apps/toy/metrics?limit=99999999999999999999",
        "/v1/apps/toy/events?since=0001-01-01T00:00:00%2B14:00",
        "/v1/instances?state=sleeping",
        "/v1/instances?app=NOT%20AN%20APP",
    ],
)
def test_bad_paths_and_queries_are_422(api: Api, url: str) -> None:
    api.register()
    assert_error(api.call("GET", url), 422)


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "name",
                    "models",
                    "slo",
                    "latency_ms",
                    "budget_usd_per_hr",
                    "instance_types",
                    "reason",
                    "rate_qps",
                    "trace",
                    "kind",
                    "cv2",
                    "duration_s",
                    "seed",
                    "profiles",
                    "batch_dist",
                    "max_counts",
                    "cascade",
                    "catalog",
                    "percentile",
                    "x",
                ]
            )
            | st.text(max_size=8),
            children,
            max_size=6,
        )
    ),
    max_leaves=20,
)
ROUTES = [
    ("POST", "/v1/apps"),
    ("PUT", "/v1/apps/toy"),
    ("PUT", "/v1/apps/toy/budget"),
    ("POST", "/v1/apps/toy/plans"),
    ("POST", "/v1/apps/toy/plans/1/apply"),
]


def _near_valid() -> st.SearchStrategy[Any]:
    """Valid documents with one value replaced by junk: they reach the deeper checks."""
    documents = [
        spec(),
        {"budget_usd_per_hr": 3.0, "reason": "cut"},
        {"rate_qps": 50.0},
        {"trace": {"kind": "gamma", "rate_qps": 50.0, "cv2": 2.0}},
    ]

    def mutate(document: dict[str, Any], key_index: int, value: Any) -> dict[str, Any]:
        key = sorted(document)[key_index % len(document)]
        return {**document, key: value}

    return st.builds(mutate, st.sampled_from(documents), st.integers(0, 10), JSON)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(route=st.sampled_from(ROUTES), body=JSON | _near_valid())
def test_junk_bodies_are_never_a_5xx(api: Api, route: tuple[str, str], body: Any) -> None:
    if api.call("GET", "/v1/apps/toy").status_code == 404:
        api.register()
    method, url = route
    content = json.dumps(body, allow_nan=True).encode()
    response = api.call(method, url, content=content, headers={"Content-Type": "application/json"})
    assert response.status_code < 500, (route, body, response.text)
    if response.status_code >= 400:
        assert_error(response, response.status_code)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(route=st.sampled_from(ROUTES), raw=st.binary(max_size=64))
def test_junk_bytes_are_never_a_5xx(api: Api, route: tuple[str, str], raw: bytes) -> None:
    method, url = route
    response = api.call(method, url, content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code < 500, (route, raw, response.text)


def test_deeply_nested_json_is_a_4xx(api: Api) -> None:
    body = b"[" * 100_000 + b"]" * 100_000
    response = api.call(
        "POST", "/v1/apps", content=body, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "malformed_json" and "nested too deep" in error["message"], error


def test_a_number_too_long_to_read_is_a_4xx_that_says_so(api: Api) -> None:
    body = b'{"name": "x", "budget_usd_per_hr": ' + b"9" * 5000 + b"}"
    response = api.call(
        "POST", "/v1/apps", content=body, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "malformed_json" and "4,300 digits" in error["message"], error


# --- plans -----------------------------------------------------------------------------------


def test_preview_list_read_and_apply_a_plan(api: Api) -> None:
    api.register()
    plan = api.preview(rate_qps=200.0)
    assert plan["status"] == "previewed"
    assert plan["number"] == 1
    assert plan["app"] == "toy"
    assert plan["feasible"] is True
    assert plan["cost_usd_per_hr"] <= 4.0
    assert plan["stages"][0]["name"] == "m"
    assert plan["trace"]["count"] > 1000
    assert "poisson at 200 qps" in plan["trace"]["source"]
    # The rate planned for and the end-to-end prediction (one stage: the stage's own).
    assert plan["rate_qps"] == plan["planned_rate_qps"] == pytest.approx(plan["trace"]["rate_qps"])
    assert plan["predicted_p99_ms"] == plan["stages"][0]["predicted_p99_ms"]
    assert 0 < plan["predicted_p99_ms"] <= 40.0

    listed = api.call("GET", "/v1/apps/toy/plans", "viewer").json()
    assert [p["id"] for p in listed] == [plan["id"]]
    assert api.call("GET", f"/v1/apps/toy/plans/{plan['id']}", "viewer").json() == plan

    applied = api.call("POST", f"/v1/apps/toy/plans/{plan['id']}/apply", "operator")
    assert applied.status_code == 200, applied.text
    assert applied.json()["status"] == "applied"
    assert api.call("GET", "/v1/apps/toy").json()["applied_plan_id"] == plan["id"]
    decisions = api.call("GET", "/v1/apps/toy/decisions", "viewer").json()
    assert [d["kind"] for d in decisions] == ["plan_applied"]
    assert decisions[0]["numbers"]["plan_id"] == plan["id"]

    # Applied once; and the app changed (applying bumps its version), so a second is stale.
    assert_error(api.call("POST", f"/v1/apps/toy/plans/{plan['id']}/apply"), 409, "conflict")
    second = api.preview(rate_qps=100.0)
    assert api.call("POST", f"/v1/apps/toy/plans/{second['id']}/apply").status_code == 200
    statuses = [p["status"] for p in api.call("GET", "/v1/apps/toy/plans").json()]
    assert statuses == ["superseded", "applied"]


def test_an_apply_whose_decision_was_not_written_is_not_applied_either(api: Api) -> None:
    """The write of the apply's decision fails (the process dies there, or its database write
    does): the plan is not applied either, and applying it again applies it and says it once.
    The decision used to be written after the apply, in a transaction of its own: the plan was
    applied and never said, and applying it again was a 409 (applied already)."""
    api.register()
    plan = api.preview(rate_qps=200.0)
    with decision_write_fails(f"plan {plan['id']} applied by") as failing:
        died = api.call("POST", f"/v1/apps/toy/plans/{plan['id']}/apply", "operator")
        assert died.status_code == 500 and failing == [], died.text
    assert api.call("GET", "/v1/apps/toy").json()["applied_plan_id"] is None
    applied = api.call("POST", f"/v1/apps/toy/plans/{plan['id']}/apply", "operator")
    assert applied.status_code == 200, applied.text
    decisions = api.call("GET", "/v1/apps/toy/decisions", "viewer").json()
    assert [(d["kind"], d["numbers"]["plan_id"]) for d in decisions] == [
        ("plan_applied", plan["id"])
    ]


def test_a_plan_is_named_by_its_id_everywhere(api: Api) -> None:
    """``plans apply --id`` takes the plan's id, so the decision log names the id, not the
    per-app number (here they differ: another app's plan came first)."""
    api.register(name="other")
    api.preview(app="other")
    api.register()
    plan = api.preview()
    assert (plan["id"], plan["number"]) == (2, 1)
    assert api.call("POST", f"/v1/apps/toy/plans/{plan['id']}/apply").status_code == 200
    decisions = api.call("GET", "/v1/apps/toy/decisions", "viewer").json()
    assert decisions[0]["reason"].startswith("plan 2 applied by ")


def test_a_gamma_trace_plan(api: Api) -> None:
    api.register()
    plan = api.preview(
        trace={"kind": "gamma", "rate_qps": 150.0, "cv2": 4.0, "duration_s": 20.0, "seed": 3},
        seed=1,
    )
    assert plan["seed"] == 1
    assert "gamma at 150 qps, cv2 4" in plan["trace"]["source"]
    assert plan["trace"]["count"] < 4000


def test_an_infeasible_rate_is_a_plan_with_the_highest_feasible_rate(api: Api) -> None:
    api.register(budget_usd_per_hr=0.3)
    plan = api.preview(rate_qps=5000.0)
    assert plan["feasible"] is False
    assert plan["max_feasible_qps"] < 5000.0
    assert plan["rate_qps"] == plan["max_feasible_qps"]
    assert plan["predicted_p99_ms"] is not None or plan["stages"] == []


def test_a_plan_stored_before_plans_carried_the_prediction_reads(api: Api) -> None:
    api.register()
    plan = api.preview(rate_qps=100.0)
    document = api.store.get_plan("toy", plan["id"]).document
    older = {k: v for k, v in document.items() if k not in ("rate_qps", "predicted_p99_ms")}
    stored = api.store.create_plan("toy", older)
    read = api.call("GET", f"/v1/apps/toy/plans/{stored.id}", "viewer").json()
    assert read["rate_qps"] == read["planned_rate_qps"] == plan["rate_qps"]
    assert read["predicted_p99_ms"] is None


def test_a_plan_made_before_a_budget_change_is_stale(api: Api) -> None:
    api.register()
    plan = api.preview()
    api.call("PUT", "/v1/apps/toy/budget", json={"budget_usd_per_hr": 3.0, "reason": "cut"})
    error = assert_error(api.call("POST", f"/v1/apps/toy/plans/{plan['id']}/apply"), 409)
    assert "version" in error["message"]


def test_a_plan_with_no_stages_is_not_applied(api: Api) -> None:
    """Batches of two on the one type the budget buys (r5n.large, 16 ms a batch) miss a 14 ms
    SLO at every rate: the plan is infeasible with no stages. Applying it would drain the whole
    fleet: a 409 that changes nothing."""
    api.register(slo={"latency_ms": 14.0}, budget_usd_per_hr=0.2)
    made = api.call(
        "POST", "/v1/apps/toy/plans", json={"trace": {"rate_qps": 5, "batch_dist": "fixed:2"}}
    )
    assert made.status_code == 201, made.text
    plan = made.json()
    assert plan["feasible"] is False and plan["stages"] == []
    error = assert_error(api.call("POST", f"/v1/apps/toy/plans/{plan['id']}/apply"), 409)
    assert f"plan {plan['id']} of app 'toy' has no stages" in error["message"]
    assert api.call("GET", "/v1/apps/toy").json()["applied_plan_id"] is None
    assert api.call("GET", f"/v1/apps/toy/plans/{plan['id']}").json()["status"] == "previewed"


def test_an_unknown_plan_is_a_404(api: Api) -> None:
    api.register()
    assert_error(api.call("GET", "/v1/apps/toy/plans/42"), 404, "not_found")
    assert_error(api.call("POST", "/v1/apps/toy/plans/42/apply"), 404, "not_found")


def test_an_slo_no_type_can_meet_is_a_422(api: Api) -> None:
    # Registering it is refused now; an app stored with one before that rule previews a 422.
    created = api.register()
    stored = {**created["spec"], "slo": {"latency_ms": 1.0, "percentile": 99.0}}
    api.store.update_app("toy", stored, who="test")
    assert_error(
        api.call("POST", "/v1/apps/toy/plans", json={"rate_qps": 10.0}), 422, "unplannable"
    )


def test_two_applies_at_once_one_wins(api: Api) -> None:
    api.register()
    plan = api.preview()
    statuses = _at_once(
        [lambda: api.call("POST", f"/v1/apps/toy/plans/{plan['id']}/apply", "operator")] * 2
    )
    assert sorted(statuses) == [200, 409]


def test_applies_of_two_plans_at_once_one_wins(api: Api) -> None:
    api.register()
    first, second = api.preview(rate_qps=100.0), api.preview(rate_qps=150.0)
    statuses = _at_once(
        [
            lambda: api.call("POST", f"/v1/apps/toy/plans/{first['id']}/apply", "operator"),
            lambda: api.call("POST", f"/v1/apps/toy/plans/{second['id']}/apply", "operator"),
        ]
    )
    assert sorted(statuses) == [200, 409]


def _at_once(calls: list[Callable[[], httpx.Response]]) -> list[int]:
    """Run the calls from as many threads, released together; their statuses."""
    start = threading.Barrier(len(calls))
    statuses: list[int] = []
    lock = threading.Lock()

    def run(call: Callable[[], httpx.Response]) -> None:
        start.wait()
        status = call().status_code
        with lock:
            statuses.append(status)

    threads = [threading.Thread(target=run, args=(call,)) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return statuses


# --- budget ----------------------------------------------------------------------------------


def test_budget_get_and_set_with_audit(api: Api) -> None:
    api.register()
    budget = api.call("GET", "/v1/apps/toy/budget", "viewer").json()
    assert budget["budget_usd_per_hr"] == 4.0
    assert budget["fleet_cost_usd_per_hr"] == 0.0
    assert [c["reason"] for c in budget["changes"]] == ["app registered"]

    api.clock.advance(60.0)
    response = api.call(
        "PUT",
        "/v1/apps/toy/budget",
        "operator",
        json={"budget_usd_per_hr": 6.5, "reason": "black friday"},
    )
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["budget_usd_per_hr"] == 6.5
    assert answer["previous_usd_per_hr"] == 4.0
    assert answer["drain"] == [] and answer["note"] is None

    changes = api.call("GET", "/v1/apps/toy/budget").json()["changes"]
    last = changes[-1]
    assert last["who"] == "operator-token"
    assert (last["old_usd_per_hr"], last["new_usd_per_hr"]) == (4.0, 6.5)
    assert last["reason"] == "black friday"
    assert last["at"].startswith((FAKE_EPOCH + timedelta(seconds=60)).strftime("%Y-%m-%dT%H:%M"))
    assert api.call("GET", "/v1/apps/toy").json()["spec"]["budget_usd_per_hr"] == 6.5
    # No drain, no decision.
    assert api.call("GET", "/v1/apps/toy/decisions").json() == []


def test_a_budget_below_the_fleet_cost_lists_instances_to_drain(api: Api) -> None:
    api.register(budget_usd_per_hr=10.0)
    prices = {"g4dn.xlarge": 0.526, "r5n.large": 0.149, "t3.xlarge": 0.1664}
    ids = {}
    for i, itype in enumerate(["g4dn.xlarge", "r5n.large", "t3.xlarge", "t3.xlarge"]):
        record = api.store.record_instance(
            "toy",
            request_id=f"r{i}",
            instance_type=itype,
            price_usd_per_hr=prices[itype],
            provider_id=f"i-{i:04d}",
            state="running",
        )
        ids[i] = record.id
    fleet_cost = sum(prices[t] for t in ["g4dn.xlarge", "r5n.large", "t3.xlarge", "t3.xlarge"])

    answer = api.call(
        "PUT", "/v1/apps/toy/budget", json={"budget_usd_per_hr": 0.7, "reason": "cost cut"}
    ).json()
    assert answer["fleet_cost_usd_per_hr"] == pytest.approx(fleet_cost)
    drained = answer["drain"]
    # t3.xlarge serves least per dollar (12 + 6b ms for 0.1664/hr), then r5n.large.
    assert [d["instance_type"] for d in drained] == ["t3.xlarge", "t3.xlarge"]
    assert {d["provider_id"] for d in drained} == {"i-0002", "i-0003"}
    assert all(d["qps_per_usd"] > 0 for d in drained)
    assert [d["qps_per_usd"] for d in drained] == sorted(d["qps_per_usd"] for d in drained)
    kept = fleet_cost - sum(d["price_usd_per_hr"] for d in drained)
    assert kept <= 0.7
    assert "drain" in answer["note"]

    (decision,) = api.call("GET", "/v1/apps/toy/decisions?kind=budget_drain").json()
    assert set(decision["numbers"]["drain"]) == {ids[2], ids[3]}
    assert decision["numbers"]["budget_usd_per_hr"] == 0.7


def test_a_budget_cut_whose_drain_was_not_said_is_not_made_either(api: Api) -> None:
    """The write of the cut's ``budget_drain`` decision fails (the process dies there, or its
    database write does): the budget is not changed either, and setting it again changes it and
    says the drain once. The decision used to be written after the change, in a transaction of
    its own: the budget was cut and the drain never said, unless the cut was made again."""
    api.register(budget_usd_per_hr=10.0)
    for i, itype in enumerate(["r5n.large", "t3.xlarge"]):
        api.store.record_instance(
            "toy",
            request_id=f"r{i}",
            instance_type=itype,
            price_usd_per_hr={"r5n.large": 0.149, "t3.xlarge": 0.1664}[itype],
            provider_id=f"i-{i:04d}",
            state="running",
        )
    body = {"budget_usd_per_hr": 0.2, "reason": "cost cut"}
    with decision_write_fails("budget lowered to 0.2 USD/hr") as failing:
        died = api.call("PUT", "/v1/apps/toy/budget", json=body)
        assert died.status_code == 500 and failing == [], died.text
    assert api.call("GET", "/v1/apps/toy").json()["budget_usd_per_hr"] == 10.0
    answer = api.call("PUT", "/v1/apps/toy/budget", json=body)
    assert answer.status_code == 200, answer.text
    (decision,) = api.call("GET", "/v1/apps/toy/decisions?kind=budget_drain").json()
    assert decision["numbers"]["budget_usd_per_hr"] == 0.2


def test_a_budget_cuts_note_counts_the_instances_draining_already(api: Api) -> None:
    """Five running and one draining (a scale-down's): its note said "the fleet costs 0.894
    USD/hr ... 1 instance(s) to drain (0.149 USD/hr)", which leaves it over the budget; the
    reconciler's cap ends the draining one at once too, and the note says so now."""
    api.register(budget_usd_per_hr=10.0)
    for i, state in enumerate(["running"] * 5 + ["draining"]):
        api.store.record_instance(
            "toy", request_id=f"r{i}", instance_type="r5n.large", price_usd_per_hr=0.149,
            state=state,
        )  # fmt: skip
    answer = api.call(
        "PUT", "/v1/apps/toy/budget", json={"budget_usd_per_hr": 0.6, "reason": "cut"}
    ).json()
    assert len(answer["drain"]) == 1  # the kept five at 0.745 USD/hr: one goes
    assert answer["note"].endswith("and the 1 draining already (0.149 USD/hr) end at once")


def test_a_budget_cuts_drain_names_the_profile_runs_workers_the_guard_ends(api: Api) -> None:
    """The answer named a fleet instance while the reconciler ended every profile and rollout
    worker instead (a tester); both now end a profile run's workers first, then a rollout's,
    whole, no more than the budget needs."""
    api.register(budget_usd_per_hr=10.0)
    fleet = [
        api.store.record_instance(
            "toy", request_id=f"r{i}", instance_type="r5n.large", price_usd_per_hr=0.149,
            state="running",
        ).id
        for i in range(3)
    ]  # fmt: skip
    run = [
        api.store.record_instance(
            "toy", request_id=f"profile:toy-1a2b3c4d-{t}", instance_type=t,
            price_usd_per_hr=PRICES[t], state="running",
        ).id
        for t in ("r5n.large", "t3.xlarge")
    ]  # fmt: skip
    api.store.record_instance(
        "toy", request_id="profile:rollout-toy-2-t6kdc0-r5n.large-1", instance_type="r5n.large",
        price_usd_per_hr=0.149, state="running",
    )  # fmt: skip
    budget = 3 * 0.149 + 0.149 + 0.01  # the fleet and the rollout's worker
    answer = api.call(
        "PUT", "/v1/apps/toy/budget", json={"budget_usd_per_hr": budget, "reason": "cut"}
    ).json()
    assert {d["id"] for d in answer["drain"]} == set(run)
    assert not {d["id"] for d in answer["drain"]} & set(fleet)


def test_a_budget_cut_that_drains_tells_the_gear_switcher_first(api: Api) -> None:
    """The service's hook (its gear switcher's budget_changed) runs within the request, before
    the reconciler's next tick drains; a raise that drains nothing does not call it."""
    told: list[str] = []
    state = api.client.app.state  # type: ignore[attr-defined]
    state.services = dataclasses.replace(state.services, budget_changed=told.append)
    api.register(budget_usd_per_hr=10.0)
    api.store.record_instance(
        "toy", request_id="r0", instance_type="r5n.large", price_usd_per_hr=0.149, state="running"
    )
    api.store.record_instance(
        "toy", request_id="r1", instance_type="r5n.large", price_usd_per_hr=0.149, state="running"
    )
    api.call("PUT", "/v1/apps/toy/budget", json={"budget_usd_per_hr": 20.0, "reason": "more"})
    assert told == []
    answer = api.call(
        "PUT", "/v1/apps/toy/budget", json={"budget_usd_per_hr": 0.2, "reason": "cut"}
    ).json()
    assert len(answer["drain"]) == 1 and told == ["toy"]


def test_a_forced_budget_below_the_cheapest_instance_drains_everything(api: Api) -> None:
    api.register()
    api.store.record_instance(
        "toy", request_id="r0", instance_type="r5n.large", price_usd_per_hr=0.149, state="running"
    )
    body = {"budget_usd_per_hr": 0.01, "reason": "stop", "force": True}
    answer = api.call("PUT", "/v1/apps/toy/budget", json=body).json()
    assert [d["instance_type"] for d in answer["drain"]] == ["r5n.large"]
    # The budget buys no instance now: a preview says so, as a 422 naming the field.
    error = assert_error(api.call("POST", "/v1/apps/toy/plans", json={"rate_qps": 10.0}), 422)
    assert error["field"] == "budget_usd_per_hr"


PRICES = {"g4dn.xlarge": 0.526, "r5n.large": 0.149, "t3.xlarge": 0.1664}


def running(api: Api, types: Iterable[str]) -> list[str]:
    """A running instance of toy's for each of ``types`` at its catalog price; their ids."""
    return [
        api.store.record_instance(
            "toy",
            request_id=f"r{i}",
            instance_type=itype,
            price_usd_per_hr=PRICES[itype],
            state="running",
        ).id
        for i, itype in enumerate(types)
    ]


def applied_plan(api: Api) -> tuple[dict[str, Any], float]:
    """Apply a plan for toy; the plan and its smallest serving fleet's cost, by hand."""
    plan = api.preview()
    response = api.call("POST", f"/v1/apps/toy/plans/{plan['id']}/apply", "operator")
    assert response.status_code == 200, response.text
    floor = sum(
        min(PRICES[t] for t, n in stage["fleet"].items() if n > 0) for stage in plan["stages"]
    )
    assert floor > 0
    return plan, floor


def test_a_plans_gear_plan_is_in_the_answer(api: Api) -> None:
    """A cascade's gear plan, in the stored plan document, is in the plan the API answers (as
    docs/cascades.md says); it was dropped by the answer's schema."""
    api.register()
    single = api.preview()
    assert single["gear_plan"] is None  # one model: no gears
    gears = {"ranges": [{"low_qps": 0.0, "high_qps": 10.0, "cascade": ["m"]}], "finalists": 1}
    document = {**api.store.get_plan("toy", single["id"]).document, "gear_plan": gears}
    plan = api.store.create_plan("toy", document)
    answer = api.call("GET", f"/v1/apps/toy/plans/{plan.id}")
    assert answer.status_code == 200, answer.text
    assert answer.json()["gear_plan"] == gears


def test_an_slo_no_model_meets_alone_is_refused_on_register_and_on_replace(api: Api) -> None:
    """The fastest model answers in about 4 ms (g4dn.xlarge at batch 1): an SLO under that was
    registered, and a live app's replaced with it refused every query with 429."""
    body = {**spec(), "slo": {"latency_ms": 0.01}}
    error = assert_error(api.call("POST", "/v1/apps", "operator", json=body), 422)
    assert error["field"] == "slo.latency_ms"
    assert "'m' on g4dn.xlarge" in error["message"] and "no fleet meets it" in error["message"]
    assert api.call("GET", "/v1/apps").json() == []

    created = api.register()
    replaced = {**spec(), "slo": {"latency_ms": 1.0}}
    error = assert_error(api.call("PUT", "/v1/apps/toy", "operator", json=replaced), 422)
    assert error["field"] == "slo.latency_ms"
    after = api.call("GET", "/v1/apps/toy").json()
    assert after["version"] == created["version"]
    assert after["spec"]["slo"]["latency_ms"] == 40.0


def test_a_budget_below_the_smallest_serving_fleet_is_a_409_and_changes_nothing(
    api: Api,
) -> None:
    api.register()
    plan, floor = applied_plan(api)
    running(api, plan["stages"][0]["fleet"])
    before = api.call("GET", "/v1/apps/toy/budget").json()

    body = {"budget_usd_per_hr": 0.01, "reason": "oops"}
    error = assert_error(api.call("PUT", "/v1/apps/toy/budget", json=body), 409, "conflict")
    assert f"{floor:.4g} USD/hr" in error["message"]
    assert "smallest serving fleet" in error["message"] and '"force": true' in error["message"]

    after = api.call("GET", "/v1/apps/toy/budget").json()
    assert after == before  # the budget and its audit trail unchanged
    assert api.call("GET", "/v1/apps/toy").json()["budget_usd_per_hr"] == 4.0
    assert api.call("GET", "/v1/apps/toy/decisions?kind=budget_drain").json() == []

    # Forced, it goes through and drains everything.
    forced = api.call("PUT", "/v1/apps/toy/budget", json={**body, "force": True})
    assert forced.status_code == 200, forced.text
    answer = forced.json()
    assert answer["budget_usd_per_hr"] == 0.01
    assert len(answer["drain"]) == len(plan["stages"][0]["fleet"])
    assert api.call("GET", "/v1/apps/toy/budget").json()["changes"][-1]["new_usd_per_hr"] == 0.01
    assert len(api.call("GET", "/v1/apps/toy/decisions?kind=budget_drain").json()) == 1

    # A raise from there is not refused, though still below the floor; the instances no
    # reconciler has ended yet are still over it, and its drain names them, as the budget
    # guard drains them (a hard limit: kept as the stage's last, they were named as kept while
    # the guard drained them).
    raised = api.call(
        "PUT", "/v1/apps/toy/budget", json={"budget_usd_per_hr": 0.02, "reason": "up"}
    )
    assert raised.status_code == 200, raised.text
    assert raised.json()["budget_usd_per_hr"] == 0.02
    assert len(raised.json()["drain"]) == len(plan["stages"][0]["fleet"])
    # A cut below the floor is still refused, unforced.
    cut = {"budget_usd_per_hr": 0.015, "reason": "down"}
    assert_error(api.call("PUT", "/v1/apps/toy/budget", json=cut), 409, "conflict")


def test_below_the_on_demand_floor_a_spot_fleet_that_fits_is_said_to(api: Api) -> None:
    """The floor stays at on-demand prices (a spot instance kept at its launch price could be
    re-priced past the budget, or replaced on demand, leaving the stage empty); when the fleet
    running now fits the new budget, the refusal says so, and forced, nothing drains."""
    api.register()
    plan, floor = applied_plan(api)
    stage = plan["stages"][0]["fleet"]
    assert len(plan["stages"]) == 1
    cheapest = min((t for t, n in stage.items() if n > 0), key=lambda t: PRICES[t])
    spot = api.store.record_instance(
        "toy",
        request_id="spot-1",
        instance_type=cheapest,
        price_usd_per_hr=PRICES[cheapest] * 0.3,
        state="running",
        market="spot",
    )
    body = {"budget_usd_per_hr": PRICES[cheapest] * 0.5, "reason": "spot fits"}
    assert floor > body["budget_usd_per_hr"]
    error = assert_error(api.call("PUT", "/v1/apps/toy/budget", json=body), 409, "conflict")
    running = PRICES[cheapest] * 0.3
    assert f"the fleet runs at {running:.4g} USD/hr now, within it" in error["message"]
    forced = api.call("PUT", "/v1/apps/toy/budget", json={**body, "force": True})
    assert forced.status_code == 200 and forced.json()["drain"] == []
    assert api.store.get_instance(spot.id).state == "running"


def test_a_spec_whose_budget_is_below_the_smallest_serving_fleet_is_a_409_too(api: Api) -> None:
    """`heteroplane app apply` with a lower budget in the spec is a budget change like PUT
    .../budget's: below the smallest serving fleet a 409 (saying how to force it) that changes
    nothing; at or above it, one audit row as the budget route's. A 10 ms SLO only the GPU
    meets: the plan's smallest serving fleet (one g4dn.xlarge) costs more than the cheapest
    candidate (r5n.large), the spec's own floor."""
    api.register(slo={"latency_ms": 10.0})
    plan, floor = applied_plan(api)
    assert set(plan["stages"][0]["fleet"]) == {"g4dn.xlarge"} and floor == PRICES["g4dn.xlarge"]
    api.store.record_instance(
        "toy",
        request_id="r0",
        instance_type="g4dn.xlarge",
        price_usd_per_hr=floor,
        state="running",
    )
    spec = api.call("GET", "/v1/apps/toy").json()["spec"]
    before = api.call("GET", "/v1/apps/toy/budget").json()
    low = {**spec, "budget_usd_per_hr": 0.3}
    error = assert_error(api.call("PUT", "/v1/apps/toy", json=low), 409, "conflict")
    message = error["message"]
    assert "smallest serving fleet" in message and f"{floor:.4g} USD/hr" in message
    assert "heteroplane budget set --app toy --usd-per-hr 0.3 --force" in message
    assert api.call("GET", "/v1/apps/toy/budget").json() == before
    assert api.call("GET", "/v1/apps/toy").json()["spec"] == spec

    lean = {**spec, "budget_usd_per_hr": floor}
    response = api.call("PUT", "/v1/apps/toy", json=lean)
    assert response.status_code == 200, response.text
    changes = api.call("GET", "/v1/apps/toy/budget").json()["changes"]
    assert len(changes) == len(before["changes"]) + 1  # one audit row, not two
    assert (changes[-1]["new_usd_per_hr"], changes[-1]["reason"]) == (floor, "spec updated")


def test_a_spec_lowering_its_budget_under_the_fleet_records_the_budget_routes_drain(
    api: Api,
) -> None:
    """A lower budget in the spec (`heteroplane app apply`) drains as PUT .../budget's does and
    records the same budget_drain decision naming the instances to go (it recorded none)."""
    api.register(budget_usd_per_hr=10.0)
    ids = running(api, ["g4dn.xlarge", "r5n.large", "t3.xlarge", "t3.xlarge"])
    spec = api.call("GET", "/v1/apps/toy").json()["spec"]
    raised = api.call("PUT", "/v1/apps/toy", json={**spec, "budget_usd_per_hr": 12.0})
    assert raised.status_code == 200, raised.text
    assert api.call("GET", "/v1/apps/toy/decisions?kind=budget_drain").json() == []

    response = api.call("PUT", "/v1/apps/toy", json={**spec, "budget_usd_per_hr": 0.7})
    assert response.status_code == 200, response.text
    (decision,) = api.call("GET", "/v1/apps/toy/decisions?kind=budget_drain").json()
    assert set(decision["numbers"]["drain"]) == {ids[2], ids[3]}  # the t3.xlarge, least value
    assert decision["numbers"]["budget_usd_per_hr"] == 0.7
    assert "budget lowered to 0.7 USD/hr" in decision["reason"]


def test_a_spec_lowering_its_budget_is_held_to_the_floor_at_its_own_prices(api: Api) -> None:
    """The floor a spec's lower budget is checked against is priced by that spec (its catalog),
    not by the one it replaces: a catalog that makes the planned type cheaper lets a budget
    through that the old prices would have refused."""
    api.register(slo={"latency_ms": 10.0})
    plan, floor = applied_plan(api)
    assert set(plan["stages"][0]["fleet"]) == {"g4dn.xlarge"} and floor == PRICES["g4dn.xlarge"]
    api.store.record_instance(
        "toy", request_id="r0", instance_type="g4dn.xlarge", price_usd_per_hr=floor,
        state="running",
    )  # fmt: skip
    (api.data_dir / "cheap.csv").write_text("instance_type,price_usd_per_hr\ng4dn.xlarge,0.2\n")
    spec = api.call("GET", "/v1/apps/toy").json()["spec"]
    cheaper = {**spec, "budget_usd_per_hr": 0.3, "catalog": str(api.data_dir / "cheap.csv")}
    response = api.call("PUT", "/v1/apps/toy", json=cheaper)
    assert response.status_code == 200, response.text
    assert api.call("GET", "/v1/apps/toy").json()["budget_usd_per_hr"] == 0.3
    # Below the floor at the new prices, still a 409.
    error = assert_error(
        api.call("PUT", "/v1/apps/toy", json={**cheaper, "budget_usd_per_hr": 0.15}), 409
    )
    assert "smallest serving fleet" in error["message"] and "0.2 USD/hr" in error["message"]


def test_a_budget_at_the_smallest_serving_fleet_keeps_one_instance_per_stage(api: Api) -> None:
    api.register()
    plan, floor = applied_plan(api)
    planned = {t for stage in plan["stages"] for t, n in stage["fleet"].items() if n > 0}
    running(api, sorted(planned) * 2)
    response = api.call(
        "PUT", "/v1/apps/toy/budget", json={"budget_usd_per_hr": floor, "reason": "lean"}
    )
    assert response.status_code == 200, response.text
    drained = {d["id"] for d in response.json()["drain"]}
    kept = [i for i in api.store.list_instances("toy") if i.id not in drained]
    for stage in plan["stages"]:
        assert any(stage["fleet"].get(i.instance_type, 0) > 0 for i in kept), stage
    assert sum(i.price_usd_per_hr for i in kept) == pytest.approx(floor)


def test_an_app_without_an_applied_plan_takes_a_budget_that_buys_an_instance(api: Api) -> None:
    api.register()
    api.preview()  # previewed, not applied: no serving floor
    cheapest = min(PRICES.values())
    response = api.call(
        "PUT", "/v1/apps/toy/budget", json={"budget_usd_per_hr": cheapest, "reason": "lean"}
    )
    assert response.status_code == 200, response.text
    assert api.call("GET", "/v1/apps/toy").json()["budget_usd_per_hr"] == cheapest
    api.preview()  # the stored budget passes its own validation


def test_a_budget_that_buys_no_instance_is_refused_as_registering_at_it_is(api: Api) -> None:
    """Without an applied plan (no serving floor) 0.0001 USD/hr was taken, and the app's stored
    state then failed its own validation: a preview's 422 "buys no instance", a PUT of its own
    stored spec refused. Now a 422 naming the field, as registering the app at that budget is,
    that changes nothing; forced, it goes through (everything drains) as below the floor."""
    refused = assert_error(
        api.call("POST", "/v1/apps", "operator", json={**spec(), "budget_usd_per_hr": 0.0001}),
        422,
        "invalid_spec",
    )
    api.register()
    before = api.call("GET", "/v1/apps/toy/budget").json()
    body = {"budget_usd_per_hr": 0.0001, "reason": "t"}
    error = assert_error(api.call("PUT", "/v1/apps/toy/budget", json=body), 422, "invalid_spec")
    assert error["field"] == refused["field"] == "budget_usd_per_hr"
    assert error["message"] == (
        f'{refused["message"]}; send "force": true to set it anyway (everything drains)'
    )
    assert "0.0001 USD/hr buys no instance: the cheapest candidate, r5n.large" in error["message"]
    assert api.call("GET", "/v1/apps/toy/budget").json() == before  # no audit row
    stored = api.call("GET", "/v1/apps/toy").json()["spec"]
    assert api.call("PUT", "/v1/apps/toy", json=stored).status_code == 200

    forced = api.call("PUT", "/v1/apps/toy/budget", json={**body, "force": True})
    assert forced.status_code == 200, forced.text
    assert api.call("GET", "/v1/apps/toy").json()["budget_usd_per_hr"] == 0.0001


def test_parallel_budget_changes_are_all_audited(api: Api) -> None:
    api.register()
    values = [1.0 + i for i in range(8)]

    def setter(value: float) -> Callable[[], httpx.Response]:
        body = {"budget_usd_per_hr": value, "reason": f"set {value}"}
        return lambda: api.call("PUT", "/v1/apps/toy/budget", "operator", json=body)

    statuses = _at_once([setter(value) for value in values])
    assert statuses == [200] * len(values)
    changes = api.call("GET", "/v1/apps/toy/budget").json()["changes"]
    assert sorted(c["new_usd_per_hr"] for c in changes[1:]) == values
    # The audit trail is a chain: each change starts from the one before.
    for before, after in itertools.pairwise(changes):
        assert after["old_usd_per_hr"] == before["new_usd_per_hr"]
    final = api.call("GET", "/v1/apps/toy").json()["budget_usd_per_hr"]
    assert final in values
    assert final == changes[-1]["new_usd_per_hr"]


# --- fleet, events, metrics ------------------------------------------------------------------


def test_an_instance_says_what_it_is_for(api: Api) -> None:
    """The app's fleet, a rollout's worker, a profile run's: read off the request id, so that
    ``heteroplane fleet`` names what the stages do not place (a tester read "-" for the new
    version's workers serving every query of their model in a handover)."""
    api.register()
    made = {
        request_id: api.store.record_instance(
            "toy", request_id=request_id, instance_type="t3.xlarge", price_usd_per_hr=0.1664
        ).id
        for request_id in ("toy-1", "profile:rollout-toy-7-t3.xlarge-1", "profile:toy-1a2b-t3")
    }
    roles = {
        i["id"]: (i["role"], i["rollout_id"])
        for i in api.call("GET", "/v1/instances?app=toy", "viewer").json()
    }
    assert roles == {
        made["toy-1"]: ("fleet", None),
        made["profile:rollout-toy-7-t3.xlarge-1"]: ("rollout", 7),
        made["profile:toy-1a2b-t3"]: ("profile_run", None),
    }


def test_instances_fleet_and_events(api: Api) -> None:
    api.register()
    api.register(name="other")
    a = api.store.record_instance(
        "toy", request_id="a", instance_type="g4dn.xlarge", price_usd_per_hr=0.526
    )
    api.clock.advance(1.0)
    api.store.transition_instance(a.id, "pending", reason="booting", provider_id="i-aaaa")
    api.clock.advance(1.0)
    api.store.transition_instance(a.id, "running", reason="healthy")
    b = api.store.record_instance(
        "toy", request_id="b", instance_type="t3.xlarge", price_usd_per_hr=0.1664
    )
    api.store.transition_instance(b.id, "failed", reason="capacity")
    api.clock.advance(1.0)
    c = api.store.record_instance(
        "other", request_id="c", instance_type="t3.xlarge", price_usd_per_hr=0.1664
    )

    listed = api.call("GET", "/v1/instances?app=toy", "viewer").json()
    assert [(i["id"], i["provider_id"], i["instance_type"], i["state"]) for i in listed] == [
        (a.id, "i-aaaa", "g4dn.xlarge", "running"),
        (b.id, None, "t3.xlarge", "failed"),
    ]
    assert len(api.call("GET", "/v1/instances").json()) == 3
    running = api.call("GET", "/v1/instances?state=running&state=pending").json()
    assert [i["id"] for i in running] == [a.id]
    # limit: the newest that many, still oldest first (a week of a cycling fleet is thousands).
    newest = api.call("GET", "/v1/instances?limit=2").json()
    assert [i["id"] for i in newest] == [b.id, c.id]  # a, b and c a second apart
    assert api.call("GET", "/v1/instances?limit=0").status_code == 422

    fleet = api.call("GET", "/v1/apps/toy/fleet", "viewer").json()
    assert fleet["instances"] == 1
    assert fleet["cost_usd_per_hr"] == pytest.approx(0.526)
    assert fleet["by_type"] == [
        {
            "instance_type": "g4dn.xlarge",
            "count": 1,
            "price_usd_per_hr": 0.526,
            "cost_usd_per_hr": 0.526,
            "states": {"running": 1},
        }
    ]

    events = api.call("GET", "/v1/apps/toy/events", "viewer").json()
    assert [(e["from_state"], e["to_state"]) for e in events] == [
        (None, "requested"),
        ("requested", "pending"),
        ("pending", "running"),
        (None, "requested"),
        ("requested", "failed"),
    ]
    since = events[1]["at"]
    later = api.call("GET", "/v1/apps/toy/events", params={"since": since}).json()
    assert [e["to_state"] for e in later] == ["running", "requested", "failed"]
    assert len(api.call("GET", "/v1/apps/toy/events?limit=2").json()) == 2
    # A terminating instance is listed, not costed: EC2 no longer bills it, and the budget
    # guard does not count it (the fleet read as over the budget while a drained one ended).
    ending = api.store.record_instance(
        "toy", request_id="d", instance_type="g4dn.xlarge", price_usd_per_hr=0.526
    )
    api.store.transition_instance(ending.id, "pending", reason="booting", provider_id="i-dddd")
    api.store.transition_instance(ending.id, "terminating", reason="budget")
    fleet = api.call("GET", "/v1/apps/toy/fleet", "viewer").json()
    assert fleet["instances"] == 2 and fleet["cost_usd_per_hr"] == pytest.approx(0.526)
    assert fleet["by_type"][0]["states"] == {"running": 1, "terminating": 1}
    budget = api.call("GET", "/v1/apps/toy/budget", "viewer").json()
    assert budget["fleet_cost_usd_per_hr"] == pytest.approx(0.526)


def test_the_fleet_and_budget_costs_read_without_float_noise(api: Api) -> None:
    # Three instances at 0.1 USD/hr: the fleet costs 0.3, not 0.30000000000000004 (a tester's
    # sweep read that against a budget of 0.3: over it, to a client that compares), and a type's
    # mean price 0.1, not 0.10000000000000002.
    api.register()
    for i in range(3):
        row = api.store.record_instance(
            "toy", request_id=f"r{i}", instance_type="t3.xlarge", price_usd_per_hr=0.1
        )
        api.store.transition_instance(row.id, "pending", reason="booting", provider_id=f"i-{i}")
        api.store.transition_instance(row.id, "running", reason="healthy")
    fleet = api.call("GET", "/v1/apps/toy/fleet", "viewer").json()
    assert fleet["cost_usd_per_hr"] == 0.3
    assert fleet["by_type"][0]["price_usd_per_hr"] == 0.1
    assert fleet["by_type"][0]["cost_usd_per_hr"] == 0.3
    budget = api.call("GET", "/v1/apps/toy/budget", "viewer").json()
    assert budget["fleet_cost_usd_per_hr"] == 0.3


def test_metric_series(api: Api) -> None:
    api.register()
    for i in range(3):
        api.store.add_metric_sample(
            "toy", arrival_rate_qps=10.0 * i, fleet_cost_usd_per_hr=0.5, latency_p99_ms=30.0 + i
        )
        api.clock.advance(10.0)
    series = api.call("GET", "/v1/apps/toy/metrics", "viewer").json()
    assert [s["arrival_rate_qps"] for s in series] == [0.0, 10.0, 20.0]
    since = (FAKE_EPOCH + timedelta(seconds=5)).replace(tzinfo=None).isoformat()
    later = api.call("GET", "/v1/apps/toy/metrics", params={"since": since}).json()
    assert [s["latency_p99_ms"] for s in later] == [31.0, 32.0]
    metrics = api.call("GET", "/metrics").text
    assert sample(metrics, "heteroplane_app_arrival_rate_qps", app="toy") == 20.0
    assert sample(metrics, "heteroplane_app_latency_p99_ms", app="toy") == 32.0


# --- the OpenAPI document --------------------------------------------------------------------


def test_openapi_declares_every_error_response(api: Api) -> None:
    document = api.client.get("/openapi.json").json()
    assert "AppSpec" in document["components"]["schemas"]
    assert "ErrorBody" in document["components"]["schemas"]
    operations = [
        (path, method, operation)
        for path, item in document["paths"].items()
        for method, operation in item.items()
    ]
    v1 = [(p, m, o) for p, m, o in operations if p.startswith("/v1/")]
    assert len(v1) >= 16
    for path, method, operation in v1:
        responses = operation["responses"]
        needed = {"401", "403", "422"}
        if "{app}" in path or path == "/v1/instances":
            needed.add("404")
        if path.endswith("/apply") or method in ("put", "delete"):
            needed.add("409")
        if path == "/v1/apps" and method == "post":
            needed.add("409")
        assert needed <= set(responses), (path, method, sorted(responses))
        for status in needed:
            schema = responses[status]["content"]["application/json"]["schema"]
            assert schema == {"$ref": "#/components/schemas/ErrorBody"}, (path, method, status)
        assert operation.get("security"), (path, method)
    post_apps = document["paths"]["/v1/apps"]["post"]
    body_schema = post_apps["requestBody"]["content"]["application/json"]["schema"]
    assert body_schema == {"$ref": "#/components/schemas/AppSpec"}


# --- the scheduler's lifetime ----------------------------------------------------------------


def test_the_lifespan_starts_and_stops_the_scheduler(api: Api, tmp_path: Path) -> None:
    ran: list[str] = []
    scheduler = Scheduler([JobSchedule("rollup", lambda: ran.append("rollup"), 3600.0)])
    settings_ = Settings(data_dir=api.data_dir, provisioner="fake")
    app = create_app(settings_, api.store, api.clock, scheduler)
    assert not scheduler.running
    with TestClient(app) as client:
        assert scheduler.running
        assert client.get("/healthz").json()["scheduler_running"] is True
        job: GuardedJob = scheduler.jobs["rollup"]
        assert job() == "ran"
    assert not scheduler.running
    assert ran == ["rollup"]
    assert JobBodies().rollup is not None


def test_a_huge_body_is_a_413_declared_or_chunked(api: Api) -> None:
    big = b'{"name": "' + b"x" * (2 << 20) + b'"}'
    response = api.call(
        "POST", "/v1/apps", content=big, headers={"Content-Type": "application/json"}
    )
    assert_error(response, 413, "too_large")

    def chunks() -> Iterator[bytes]:
        yield b'{"name": "'
        for _ in range(40):
            yield b"x" * 65536
        yield b'"}'

    response = api.call(
        "POST", "/v1/apps", content=chunks(), headers={"Content-Type": "application/json"}
    )
    assert_error(response, 413, "too_large")


# --- what the fuzzer found (issue 21; tests/integration/test_api_fuzz.py) --------------------


@pytest.mark.parametrize(
    ("method", "url", "allow"),
    [
        ("PATCH", "/v1/apps", "GET, HEAD, POST"),
        ("OPTIONS", "/v1/apps/toy", "GET, HEAD, PUT, DELETE"),
        ("DELETE", "/v1/apps/toy/plans", "GET, HEAD, POST"),
        ("POST", "/v1/apps/toy/budget", "GET, HEAD, PUT"),
        ("PUT", "/metrics", "GET, HEAD"),
    ],
)
def test_a_405_allows_every_method_of_the_path(api: Api, method: str, url: str, allow: str) -> None:
    """Each method of a path is its own route; the Allow header names all of them."""
    response = api.call(method, url)
    error = assert_error(response, 405, "method_not_allowed")
    assert response.headers["allow"] == allow
    assert allow in error["message"]


@pytest.mark.parametrize("url", ["/healthz", "/v1/apps", "/metrics"])
def test_head_answers_as_get_without_the_body(api: Api, url: str) -> None:
    got = api.call("GET", url)
    head = api.call("HEAD", url)
    assert got.status_code == head.status_code == 200
    assert got.content and head.content == b""
    assert int(head.headers["content-length"]) > 0  # the GET's (its figures move between calls)
    assert head.headers["content-type"] == got.headers["content-type"]
    # Without the token: the GET's 401, headers and all.
    assert api.call("HEAD", url, None).status_code == api.call("GET", url, None).status_code


def test_head_where_there_is_no_get_is_a_405_naming_the_methods(api: Api) -> None:
    response = api.call("HEAD", "/v1/apps/toy/infer")
    assert response.status_code == 405 and response.headers["allow"] == "POST"


def test_metrics_without_a_token_is_the_documented_json_401(api: Api) -> None:
    assert_error(api.call("GET", "/metrics", None), 401, "unauthorized")
    responses = api.client.get("/openapi.json").json()["paths"]["/metrics"]["get"]["responses"]
    assert set(responses["200"]["content"]) == {"text/plain; version=0.0.4; charset=utf-8"}
    for status in ("401", "403", "503"):
        content = responses[status]["content"]
        assert set(content) == {"application/json"}
        assert content["application/json"]["schema"]["$ref"].endswith("/ErrorBody")


def test_a_whole_number_written_as_a_float_is_an_integer(api: Api) -> None:
    """JSON Schema's integer is any number with no fractional part: 7.0 is a seed, 7.5 is not."""
    api.register()
    assert api.preview(rate_qps=100.0, seed=7.0)["seed"] == 7
    error = assert_error(
        api.call("POST", "/v1/apps/toy/plans", json={"rate_qps": 100.0, "seed": 7.5}), 422
    )
    assert error["field"] == "seed"
    error = assert_error(
        api.call("POST", "/v1/apps/toy/plans", json={"rate_qps": 100.0, "seed": True}), 422
    )
    assert error["field"] == "seed"


def test_sample_ids_of_another_length_than_inputs_name_the_field(api: Api) -> None:
    api.register()
    body = {"inputs": [[0.0] * 64], "sample_ids": [1, 2]}
    error = assert_error(api.call("POST", "/v1/apps/toy/infer", json=body), 422)
    assert error["field"] == "sample_ids"
    assert "2 ids for 1 inputs" in error["message"]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"instance_types": ["g4dn.xlarge", ""]}, "instance_types[1]"),
        ({"max_counts": {"g4dn.xlarge": -1}}, "max_counts[g4dn.xlarge]"),
    ],
)
def test_spec_bounds_the_schema_states_are_the_ones_enforced(
    api: Api, overrides: dict[str, Any], field: str
) -> None:
    error = assert_error(api.call("POST", "/v1/apps", json={**spec(), **overrides}), 422)
    assert error["field"] == field


def test_the_openapi_document_states_what_the_api_enforces(api: Api) -> None:
    document = api.client.get("/openapi.json").json()
    schemas = document["components"]["schemas"]
    app_spec = schemas["AppSpec"]["properties"]
    assert app_spec["instance_types"]["items"]["minLength"] == 1
    assert app_spec["max_counts"]["anyOf"][0]["additionalProperties"]["minimum"] == 0
    # A preview names exactly one of trace and rate_qps; a poisson trace has cv2 = 1, a gamma
    # trace names its cv2.
    preview = document["paths"]["/v1/apps/{app}/plans"]["post"]["requestBody"]
    assert preview["required"] is True
    assert [option["required"] for option in schemas["PlanIn"]["oneOf"]] == [
        ["trace"],
        ["rate_qps"],
    ]
    poisson, gamma = schemas["TraceIn"]["allOf"]
    assert poisson["then"] == {"properties": {"cv2": {"const": 1.0}}}
    assert (gamma["if"]["properties"]["kind"], gamma["then"]) == (
        {"const": "gamma"},
        {"required": ["cv2"]},
    )
    ids = schemas["InferIn"]["properties"]["sample_ids"]["anyOf"][0]["items"]
    assert (ids["type"], ids["minimum"], ids["maximum"]) == ("integer", 0, 2**31 - 1)


def test_header_fields_over_the_limit_are_a_431(api: Api) -> None:
    """Under the test client (no HTTP server) the middleware answers; a real server's protocol
    limit is tests/integration/test_header_limits.py's."""
    assert api.call("GET", "/v1/apps", headers={"X-Padding": "x" * 8_000}).status_code == 200
    response = api.call("GET", "/v1/apps", headers={"X-Padding": "x" * 40_000})
    error = assert_error(response, 431, "headers_too_large")
    assert "32,768 bytes" in error["message"]


def test_a_plan_naming_a_type_the_provider_cannot_launch_is_not_applied(api: Api) -> None:
    """A catalog that adds a type the local provisioner cannot run (a tester's emu.cpu.ghost):
    the plan was applied, its workers never started and the app answered 503 for as long, the
    one ``plan_not_launched`` decision naming an emu.* type "emulates only emu.* types". Applied
    by hand, it is a 409 naming what the provider launches; the plan stays a preview."""
    from controlplane.apps import plans
    from controlplane.errors import ConflictError
    from provisioners.base import launch_refusal

    api.register()
    plan = api.preview()
    planned = sorted(api.store.get_plan("toy", plan["id"]).plan.fleet)

    def refusal(instance_type: str) -> str | None:
        return launch_refusal("local", {"emu.gpu"}, instance_type)

    with pytest.raises(ConflictError) as refused:
        plans.apply_plan(api.store, "toy", plan["id"], "test", refusal)
    assert (
        f"is not applied: it names {planned[0]}, and the local provisioner cannot launch"
        f" {planned[0]} (it launches emu.gpu)" in str(refused.value)
    )
    assert api.call("GET", f"/v1/apps/toy/plans/{plan['id']}").json()["status"] == "previewed"
    # The service's own provider launches it: applied.
    assert api.call("POST", f"/v1/apps/toy/plans/{plan['id']}/apply").status_code == 200
