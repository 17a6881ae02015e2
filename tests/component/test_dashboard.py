"""The dashboard's routes through FastAPI's TestClient, on a real SQLite file with a fake clock:
signing in and out (401 for a wrong token, 403 for one without the viewer scope, the cookie's
attributes, a sign-in posted from another site), the data route's auth (cookie or bearer; the
cookie never opens a ``/v1`` route) and the snapshot's shape and numbers for an app with a plan,
instances that came and went, samples, a budget change and decisions."""

from __future__ import annotations

import doctest
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from controlplane.clock import FakeClock
from controlplane.dashboard import COOKIE_NAME, ranking, routes, snapshot
from controlplane.db.store import Store
from controlplane.policies.replay import rate_per_instance_qps
from controlplane.service.app import create_app
from controlplane.serving.observations import AppTotals
from controlplane.settings import Settings
from estimator.profiles import load_profiles
from tests.component.test_api import spec, write_profiles

SCOPES = ("admin", "operator", "viewer", "infer")


@dataclass
class Dash:
    client: TestClient
    store: Store
    clock: FakeClock
    tokens: dict[str, str]
    data_dir: Path

    def bearer(self, scope: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[scope]}"}

    def sign_in(self, scope: str = "viewer", **kwargs: Any) -> httpx.Response:
        response: httpx.Response = self.client.post(
            "/dashboard/login",
            data={"token": self.tokens[scope]},
            follow_redirects=False,
            **kwargs,
        )
        return response

    def data(self, **params: Any) -> dict[str, Any]:
        response = self.client.get("/dashboard/data", params=params)
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body


@pytest.fixture
def dash(tmp_path: Path) -> Iterator[Dash]:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    write_profiles(data_dir)
    settings = Settings(data_dir=data_dir, provisioner="fake")
    clock = FakeClock()
    store = Store.from_url(settings.database_url, clock, upgrade=True)
    tokens = {scope: store.create_token(scope, name=f"{scope}-token") for scope in SCOPES}
    with TestClient(create_app(settings, store, clock), raise_server_exceptions=False) as client:
        yield Dash(client, store, clock, tokens, data_dir)
    store.close()


def test_the_modules_doctests_pass() -> None:
    for module in (snapshot, ranking, routes):
        assert doctest.testmod(module).failed == 0


# --- signing in and out ----------------------------------------------------------------------


def test_without_a_cookie_the_page_is_the_sign_in_form(dash: Dash) -> None:
    page = dash.client.get("/dashboard")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert 'id="login-form"' in page.text and 'name="token"' in page.text
    assert "login-message" not in page.text
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert page.headers["cache-control"] == "no-store"


@pytest.mark.parametrize(
    ("token", "status", "says"),
    [
        ("hp_wrong", 401, "not valid"),
        ("not even a token", 401, "not valid"),
        ("", 401, "Paste an API token"),
        ("x" * 600, 401, "not valid"),
    ],
)
def test_a_wrong_token_is_refused_with_the_form_again(
    dash: Dash, token: str, status: int, says: str
) -> None:
    answer = dash.client.post("/dashboard/login", data={"token": token}, follow_redirects=False)
    assert answer.status_code == status
    assert 'id="login-form"' in answer.text and says in answer.text
    assert COOKIE_NAME not in answer.headers.get("set-cookie", "")


def test_an_infer_token_is_refused_403(dash: Dash) -> None:
    answer = dash.sign_in("infer")
    assert answer.status_code == 403
    assert "scope infer" in answer.text and "needs viewer" in answer.text
    assert "set-cookie" not in answer.headers


@pytest.mark.parametrize("scope", ["viewer", "operator", "admin"])
def test_a_viewer_token_signs_in_with_a_strict_http_only_cookie(dash: Dash, scope: str) -> None:
    answer = dash.sign_in(scope)
    assert answer.status_code == 303
    assert answer.headers["location"] == "/dashboard"
    cookie = answer.headers["set-cookie"]
    # A session id, never the token (tests/component/test_dashboard_sessions.py: the rest).
    assert cookie.startswith(f"{COOKIE_NAME}=hs_")
    assert dash.tokens[scope] not in cookie
    for attribute in ("HttpOnly", "SameSite=strict", "Path=/dashboard", "Max-Age=28800"):
        assert attribute in cookie
    assert "Secure" not in cookie  # plain HTTP on loopback
    page = dash.client.get("/dashboard")
    assert page.status_code == 200
    assert 'id="panel-fleet"' in page.text and 'id="decision-log"' in page.text


def test_a_sign_in_posted_from_another_site_is_refused(dash: Dash) -> None:
    assert dash.sign_in(headers={"Origin": "https://evil.example"}).status_code == 403
    assert dash.sign_in(headers={"Origin": "null"}).status_code == 403
    assert dash.sign_in(headers={"Origin": "http://testserver"}).status_code == 303


def test_a_sign_in_that_is_not_a_form_is_400(dash: Dash) -> None:
    answer = dash.client.post("/dashboard/login", json={"token": dash.tokens["viewer"]})
    assert answer.status_code == 400 and 'id="login-form"' in answer.text


def test_a_revoked_token_ends_the_sign_in(dash: Dash) -> None:
    assert dash.sign_in().status_code == 303
    dash.store.revoke_token("viewer-token")
    page = dash.client.get("/dashboard")
    assert page.status_code == 401
    assert "sign-in has ended" in page.text
    assert f'{COOKIE_NAME}=""' in page.headers["set-cookie"]
    assert dash.client.get("/dashboard/data").status_code == 401


def test_sign_out_forgets_the_cookie(dash: Dash) -> None:
    assert dash.sign_in().status_code == 303
    foreign = dash.client.post(
        "/dashboard/logout", headers={"Origin": "https://evil.example"}, follow_redirects=False
    )
    assert foreign.status_code == 403 and "set-cookie" not in foreign.headers
    assert dash.client.get("/dashboard/data").status_code == 200
    out = dash.client.post("/dashboard/logout", follow_redirects=False)
    assert out.status_code == 303 and out.headers["location"] == "/dashboard"
    assert f'{COOKIE_NAME}=""' in out.headers["set-cookie"]
    assert 'id="login-form"' in dash.client.get("/dashboard").text
    assert dash.client.get("/dashboard/data").status_code == 401


def test_the_assets_are_served_and_nothing_else(dash: Dash) -> None:
    for name, kind in [
        ("dashboard.js", "text/javascript"),
        ("charts.js", "text/javascript"),
        ("dashboard.css", "text/css"),
    ]:
        answer = dash.client.get(f"/dashboard/static/{name}")
        assert answer.status_code == 200 and answer.headers["content-type"].startswith(kind)
    for name in ("login.html", "dashboard.html", "..%2f..%2fstore.py", "nope.js"):
        assert dash.client.get(f"/dashboard/static/{name}").status_code == 404


# --- the data route's auth -------------------------------------------------------------------


def test_the_data_route_needs_a_viewer(dash: Dash) -> None:
    dash.client.post("/v1/apps", json=spec(), headers=dash.bearer("operator"))
    none = dash.client.get("/dashboard/data")
    assert none.status_code == 401 and none.json()["error"]["code"] == "unauthorized"
    for header in ("Bearer", "Basic abc", "Bearer hp_unknown"):
        answer = dash.client.get("/dashboard/data", headers={"Authorization": header})
        assert answer.status_code == 401, header
    forbidden = dash.client.get("/dashboard/data", headers=dash.bearer("infer"))
    assert forbidden.status_code == 403 and forbidden.json()["error"]["code"] == "forbidden"
    for scope in ("viewer", "operator", "admin"):
        answer = dash.client.get("/dashboard/data", headers=dash.bearer(scope))
        assert answer.status_code == 200, answer.text
        assert answer.json()["viewer"] == {"name": f"{scope}-token", "scope": scope}
    dash.sign_in()
    assert dash.data()["apps"] == ["toy"]


def test_a_bearer_header_wins_over_the_cookie(dash: Dash) -> None:
    dash.sign_in("viewer")
    refused = dash.client.get("/dashboard/data", headers=dash.bearer("infer"))
    assert refused.status_code == 403


def test_the_cookie_does_not_open_the_v1_routes(dash: Dash) -> None:
    dash.sign_in("admin")
    assert dash.client.get("/dashboard/data").status_code == 200
    for url in ("/v1/apps", "/v1/instances", "/metrics"):
        assert dash.client.get(url).status_code == 401, url


def test_bad_data_queries_are_4xx(dash: Dash) -> None:
    dash.sign_in()
    assert dash.client.get("/dashboard/data", params={"app": "ghost"}).status_code == 404
    assert dash.client.get("/dashboard/data", params={"app": "Not An App"}).status_code == 422
    for window in ("0", "1e9", "nan", "x"):
        answer = dash.client.get("/dashboard/data", params={"window_s": window})
        assert answer.status_code == 422, window


def test_without_apps_the_snapshot_is_empty(dash: Dash) -> None:
    dash.sign_in()
    body = dash.data()
    assert body["apps"] == [] and body["snapshot"] is None


# --- the snapshot ----------------------------------------------------------------------------


def _apply_plan(dash: Dash) -> dict[str, Any]:
    headers = dash.bearer("operator")
    assert dash.client.post("/v1/apps", json=spec(), headers=headers).status_code == 201
    plan = dash.client.post("/v1/apps/toy/plans", json={"rate_qps": 100.0}, headers=headers)
    assert plan.status_code == 201, plan.text
    applied = dash.client.post(f"/v1/apps/toy/plans/{plan.json()['id']}/apply", headers=headers)
    assert applied.status_code == 200, applied.text
    body: dict[str, Any] = applied.json()
    return body


def _tuner_rates_qps(dash: Dash, batch_size: int) -> dict[str, float]:
    """mu_t as the tuner rates one instance of each type of the toy app's model."""
    profiles = load_profiles(dash.data_dir / "profiles.csv")
    rates = {}
    for name in ("r5n.large", "t3.xlarge"):
        profile = profiles.get_profile("m", name)
        smallest = np.array([profile.min_batch_size], dtype=np.int64)
        rates[name] = rate_per_instance_qps(profile, smallest, batch_size)
    return rates


def _launch(dash: Dash, instance_type: str, n: int, price: float) -> str:
    record = dash.store.record_instance(
        "toy", request_id=f"r-{n}", instance_type=instance_type, price_usd_per_hr=price
    )
    dash.clock.advance(10)
    dash.store.transition_instance(record.id, "pending", reason="launched", provider_id=f"p-{n}")
    dash.clock.advance(50)
    dash.store.transition_instance(record.id, "running", reason="healthy")
    return record.id


def test_a_fresh_app_has_clear_empty_states(dash: Dash) -> None:
    _apply_plan(dash)
    dash.sign_in()
    snap = dash.data()["snapshot"]
    assert snap["app"]["name"] == "toy"
    assert snap["fleet"]["instances"] == [] and snap["fleet"]["series"]["by_type"] == {}
    assert snap["load"]["has_traffic"] is False and snap["latency"]["has_data"] is False
    assert snap["cascade"]["has_data"] is False and snap["cascade"]["cascade"] is None
    assert snap["cost"]["spent_today_usd"] == 0.0 and snap["cost"]["burn_usd_per_hr"] == 0.0
    assert [d["kind"] for d in snap["decisions"]] == ["plan_applied"]
    assert snap["plan"]["status"] == "applied"


def test_a_repeated_decision_is_one_entry_with_its_count_and_last_time(dash: Dash) -> None:
    _apply_plan(dash)
    first = dash.clock.utcnow()
    for _ in range(720):
        dash.store.record_decision(
            "toy", "launch_failed", "no capacity", {"request_id": "r-1"}, key="r-1:ICE"
        )
        dash.clock.advance(0.5)
    dash.sign_in()
    snap = dash.data()["snapshot"]
    assert [d["kind"] for d in snap["decisions"]] == ["launch_failed", "plan_applied"]
    failed, applied = snap["decisions"]
    assert failed["count"] == 720 and failed["at"] == first.isoformat()
    assert failed["last_t"] - failed["t"] == pytest.approx(0.5 * 719)
    assert (applied["count"], applied["last_at"], applied["last_t"]) == (1, None, None)


def test_a_run_of_repeated_decisions_shows_the_newest_time_of_any_of_them(dash: Dash) -> None:
    # Two stages capped in turn: each repeat is merged into its stage's (older) row, so the
    # run's newest time is an older row's, not the newest row's.
    _apply_plan(dash)
    for _ in range(5):
        for stage in ("a", "b"):
            dash.store.record_decision(
                "toy", "budget_capped", f"stage {stage}", {}, key=f"{stage}:cap"
            )
            dash.clock.advance(1.0)
    made_last = dash.clock.utcnow()
    dash.store.record_decision("toy", "budget_capped", "stage a", {}, key="a:cap", at=made_last)
    dash.sign_in()
    capped, _applied = dash.data()["snapshot"]["decisions"]
    assert (capped["kind"], capped["run"], capped["count"]) == ("budget_capped", 2, 11)
    assert capped["last_at"] == made_last.isoformat()
    assert capped["last_t"] == made_last.timestamp()


def test_a_rollouts_moves_are_entries_of_their_own_and_its_waits_fold(dash: Dash) -> None:
    """The rollout loop's decisions say whether they hold it (``numbers.wait``): its waits in
    one state at one step are one entry, each move one of its own, as ``heteroplane events``
    shows them (a whole rollout had been one entry showing its last move)."""
    _apply_plan(dash)
    made = (
        ("pending", True, "waiting for the budget: 0.3 USD/hr"),
        ("pending", True, "waiting for the budget: 0.2 USD/hr"),
        ("pending", False, "profiled before traffic"),
        ("running", False, "workers of the new version running"),
        ("promoted", False, "promoted: thresholds held"),
        ("promoted", False, "handover done"),
    )
    for state, wait, what in made:
        numbers = {"rollout_id": 1, "state": state, "step_index": 0, "wait": wait}
        dash.store.record_decision("toy", "rollout", f"rollout 1: {what}", numbers)
        dash.clock.advance(1.0)
    dash.sign_in()
    decisions = [d for d in dash.data()["snapshot"]["decisions"] if d["kind"] == "rollout"]
    shown = [(d["reason"].removeprefix("rollout 1: "), d["run"]) for d in decisions]
    assert shown == [
        ("handover done", 1),
        ("promoted: thresholds held", 1),
        ("workers of the new version running", 1),
        ("profiled before traffic", 1),
        ("waiting for the budget: 0.2 USD/hr", 2),
    ], shown


def test_the_snapshot_of_an_app_at_work(dash: Dash) -> None:
    plan = _apply_plan(dash)
    start = dash.clock.utcnow()
    fleet = plan["stages"][0]["fleet"]
    assert fleet == {"r5n.large": 2}
    first = _launch(dash, "r5n.large", 1, 0.149)
    _launch(dash, "r5n.large", 2, 0.149)
    extra = _launch(dash, "t3.xlarge", 3, 0.1664)  # a scale-up, later drained
    dash.store.record_decision(
        "toy", "scale_up", "load above plan: add 1 x t3.xlarge", {"add": {"t3.xlarge": 1}}
    )
    for step in range(60):  # ten minutes of 10 s samples
        dash.clock.advance(10)
        dash.store.add_metric_sample(
            "toy",
            arrival_rate_qps=90.0 + step % 7,
            fleet_cost_usd_per_hr=0.4644,
            latency_p50_ms=10.0,
            latency_p95_ms=20.0,
            latency_p99_ms=30.0 + step % 5,
            attainment_share=1.0 if step % 2 else 0.98,
            gear="g1" if step < 30 else "g2",
            accuracy=0.97 if step < 30 else 0.95,
        )
    dash.store.transition_instance(extra, "draining", reason="scale down")
    dash.clock.advance(5)
    dash.store.transition_instance(extra, "terminating", reason="drained")
    dash.clock.advance(5)
    dash.store.transition_instance(extra, "terminated", reason="gone")
    dash.store.change_budget("toy", 3.0, reason="trim", who="ops")
    dash.store.record_decision(
        "toy", "scale_down", "load back: drain 1 x t3.xlarge", {"remove": {"t3.xlarge": 1}}
    )
    dash.clock.advance(10)
    dash.sign_in()
    snap = dash.data(app="toy", window_s=3600)["snapshot"]

    series = snap["fleet"]["series"]
    assert set(series["by_type"]) == {"r5n.large", "t3.xlarge"}
    assert max(series["by_type"]["r5n.large"]) == 2 and series["by_type"]["r5n.large"][-1] == 2
    assert max(series["by_type"]["t3.xlarge"]) == 1 and series["by_type"]["t3.xlarge"][-1] == 0
    assert len(series["t"]) == len(series["by_type"]["t3.xlarge"])
    assert snap["fleet"]["now"]["instances"] == 2 and snap["fleet"]["now"]["running"] == 2
    rows = snap["fleet"]["instances"]
    assert [r["state"] for r in rows] == ["running", "running", "terminated"]
    assert rows[0]["id"] == first and rows[0]["uptime_s"] == pytest.approx(
        (dash.clock.utcnow() - start).total_seconds()
    )
    assert rows[2]["live"] is False and rows[0]["utilisation_share"] is None

    cost = snap["cost"]
    assert cost["burn_usd_per_hr"] == pytest.approx(0.298)
    assert cost["budget_usd_per_hr"] == 3.0 and cost["budget"]["usd_per_hr"][-1] == 3.0
    assert cost["budget"]["usd_per_hr"][0] == 4.0
    # 0.4644 USD/hr from the first sample to now (600 s of samples after it + 20 s).
    assert cost["spent_today_usd"] == pytest.approx(0.4644 * 610 / 3600)
    assert cost["forecast_today_usd"] == pytest.approx(
        cost["spent_today_usd"] + 0.298 * cost["hours_left_today"]
    )
    assert len(cost["series"]["t"]) == 60

    load = snap["load"]
    assert load["has_traffic"] is True and load["arrival_rate_qps"] == 90.0 + 59 % 7
    assert load["planned_rate_qps"] == pytest.approx(plan["planned_rate_qps"])
    # Capacity on the tuner's per-instance rate (mu_t at the stage's batch size), not the
    # plan's SLO-bound throughput: two r5n.large planned.
    mu = _tuner_rates_qps(dash, plan["stages"][0]["batch_size"])
    assert load["planned_capacity_qps"] == pytest.approx(2 * mu["r5n.large"])
    assert load["planned_capacity_qps"] > plan["stages"][0]["throughput_qps"]
    # The plan's two r5n.large run again: the planned capacity; with the t3 it was more.
    assert load["capacity_qps"] == pytest.approx(load["planned_capacity_qps"])
    assert max(load["capacity"]["capacity_qps"]) == pytest.approx(
        2 * mu["r5n.large"] + mu["t3.xlarge"]
    )
    # The plan's planned envelope, against the live one from the roll-ups.
    envelope = load["envelope"]
    assert envelope["windows_s"] == plan["envelope"]["windows_s"]
    assert envelope["rate_qps"] == pytest.approx(plan["envelope"]["rate_qps"])
    assert len(envelope["live_rate_qps"]) == len(envelope["windows_s"])
    assert all(rate is not None and rate > 0 for rate in envelope["live_rate_qps"])

    latency = snap["latency"]
    assert latency["slo_ms"] == 40.0 and latency["percentile"] == 99.0
    # The plan's end-to-end prediction, a reference line beside the SLO.
    assert latency["predicted_p99_ms"] == pytest.approx(plan["predicted_p99_ms"])
    assert latency["p99_ms"] == 30.0 + 59 % 5 and latency["has_data"] is True
    assert 0.98 < latency["window_attainment_share"] < 1.0

    cascade = snap["cascade"]
    assert cascade["gears"] == ["g1", "g2"] and cascade["gear"] == "g2"
    assert cascade["accuracy"] == 0.95
    # The plan has no gear plan: nothing planned to show beside the observed accuracy.
    assert cascade["planned_accuracy"] == {} and cascade["held_out_accuracy"] is None

    kinds = [d["kind"] for d in snap["decisions"]]
    assert kinds == ["scale_down", "scale_up", "plan_applied"]  # newest first
    assert snap["decisions"][0]["numbers"] == {"remove": {"t3.xlarge": 1}}
    assert "drain 1 x t3.xlarge" in snap["decisions"][0]["reason"]

    shown = snap["plan"]
    assert shown["id"] == plan["id"] and shown["steps"] == plan["steps"]
    assert shown["rate_qps"] == pytest.approx(plan["rate_qps"])
    assert shown["predicted_p99_ms"] == pytest.approx(plan["predicted_p99_ms"])
    assert 0 < shown["predicted_p99_ms"] <= 40.0
    assert shown["stages"][0]["fleet"] == {"r5n.large": 2}
    (stage,) = shown["ranking"]["stages"]
    # Ranked under the budget the plan was made with (4 USD/hr), not the later 3.
    assert shown["ranking"]["budget_usd_per_hr"] == 4.0
    assert stage["chosen"]["fleet"] == {"r5n.large": 2}
    assert stage["chosen"]["upper_bound_qps"] > plan["planned_rate_qps"]
    assert stage["covering"][0]["chosen"] is True  # the planner kept its start mix
    bounds = [m["upper_bound_qps"] for m in stage["top"]]
    assert len(bounds) == ranking.TOP_MIXES
    assert all(a >= b - 1e-9 for a, b in itertools.pairwise(bounds))

    short = dash.data(app="toy", window_s=120)["snapshot"]
    assert len(short["cost"]["series"]["t"]) == 10  # the samples of the last 120 s
    assert short["fleet"]["series"]["by_type"]["r5n.large"][0] == 2


def test_the_spend_is_integrated_across_polls_and_restarts_at_midnight(dash: Dash) -> None:
    _apply_plan(dash)
    dash.clock.advance(22.5 * 3600)  # 22:30 UTC
    for cost in (1.0, 2.0):
        dash.store.add_metric_sample("toy", arrival_rate_qps=0.0, fleet_cost_usd_per_hr=cost)
        dash.clock.advance(1800)
    dash.sign_in()  # (now: a sign-in ends after 8 hours)
    first = dash.data()["snapshot"]["cost"]["spent_today_usd"]
    assert first == pytest.approx(1.0 * 0.5 + 2.0 * 0.5)  # 22:30 to 23:30
    assert dash.data()["snapshot"]["cost"]["spent_today_usd"] == pytest.approx(first)
    dash.clock.advance(3600)  # 00:30 the next day: the 2 USD/hr of the last sample goes on
    cost = dash.data()["snapshot"]["cost"]
    assert cost["spent_today_usd"] == pytest.approx(2.0 * 0.5)
    assert cost["hours_left_today"] == pytest.approx(23.5)
    dash.store.add_metric_sample("toy", arrival_rate_qps=0.0, fleet_cost_usd_per_hr=4.0)
    dash.clock.advance(900)
    assert dash.data()["snapshot"]["cost"]["spent_today_usd"] == pytest.approx(1.0 + 4.0 * 0.25)


def test_when_every_query_fails_the_latency_tiles_say_so(dash: Dash) -> None:
    """Good windows, then windows in which every query was refused (no instance ran): the
    newest attainment is 0 and the P99 unknown, not the last good window's figures."""
    _apply_plan(dash)
    for step in range(6):
        dash.clock.advance(10)
        failing = step >= 3
        dash.store.add_metric_sample(
            "toy",
            arrival_rate_qps=10.0,
            fleet_cost_usd_per_hr=0.0,
            latency_p50_ms=None if failing else 10.0,
            latency_p95_ms=None if failing else 20.0,
            latency_p99_ms=None if failing else 30.0,
            attainment_share=0.0 if failing else 1.0,
        )
    dash.clock.advance(5)
    dash.sign_in()
    latency = dash.data(app="toy")["snapshot"]["latency"]
    assert latency["attainment_share"] == 0.0 and latency["window_attainment_share"] == 0.5
    assert latency["p99_ms"] is None and latency["p50_ms"] is None
    assert latency["answered_none"] is True and latency["slo_met"] is False
    assert latency["has_data"] is True
    assert latency["series"]["attainment_share"][-3:] == [0.0, 0.0, 0.0]
    assert latency["outcomes"] is None  # the data route of a service without a serving loop
    # The serving loop's counters, when given, say what the failures were.
    totals = AppTotals(arrived=40, answered=30, late=0, refused=10)
    snap = snapshot.build_snapshot(
        dash.store,
        dash.store.get_app("toy"),
        dash.clock.utcnow(),
        ledger=snapshot.SpendLedger(),
        serving=lambda app: totals,
    )
    outcomes = snap["latency"]["outcomes"]
    assert (outcomes["offered"], outcomes["errors"], outcomes["refused"]) == (40, 10, 10)
    assert outcomes["attainment_share"] == 0.75
    assert outcomes["mean_ms"]["total"] == 0.0


def test_a_window_below_the_slos_percentile_misses_it(dash: Dash) -> None:
    _apply_plan(dash)
    dash.clock.advance(10)
    dash.store.add_metric_sample(
        "toy",
        arrival_rate_qps=10.0,
        fleet_cost_usd_per_hr=0.0,
        latency_p50_ms=10.0,
        latency_p95_ms=20.0,
        latency_p99_ms=30.0,  # the answered ones were fast ...
        attainment_share=0.9,  # ... but a tenth of the queries failed
    )
    dash.sign_in()
    latency = dash.data(app="toy")["snapshot"]["latency"]
    assert latency["p99_ms"] == 30.0 and latency["answered_none"] is False
    assert latency["slo_met"] is False


def test_the_cascade_panel_shows_each_gears_held_out_accuracy_from_the_plan() -> None:
    from types import SimpleNamespace

    from controlplane.dashboard.snapshot import _planned_accuracy

    gear_plan = {
        "options": [
            {"label": "tiny@0.5 -> large", "accuracy": 0.99, "held_out_accuracy": 0.97},
            {"label": "tiny", "accuracy": 0.93, "held_out_accuracy": None},
            {"accuracy": 0.5},  # no label: not shown
        ]
    }
    planned = _planned_accuracy(SimpleNamespace(gear_plan=gear_plan))  # type: ignore[arg-type]
    assert planned == {
        "tiny@0.5 -> large": {"held_out": 0.97, "in_sample": 0.99},
        "tiny": {"held_out": None, "in_sample": 0.93},
    }
    assert _planned_accuracy(None) == {}
    assert _planned_accuracy(SimpleNamespace(gear_plan=None)) == {}  # type: ignore[arg-type]
