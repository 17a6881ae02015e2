"""The dashboard in a real browser: Debian's headless Chromium, driven by Playwright for Python,
against a real ``heteroplane serve`` process on a loopback port.

The service runs the fake provisioner with the reconcile and roll-up jobs every second, so the
applied plan's instances are launched by the reconciler and the roll-up records samples; the
test adds a few minutes of load, latency, gear and accuracy samples through the store on the
same database (nothing in the service measures traffic in this setup). The browser:

1. is refused with a wrong token (401, the form again with a message) and with an ``infer``
   token (403);
2. signs in with a viewer token and sees every panel draw from the service's data (SVG paths in
   the charts, rows in the tables, the plan's bound ranking);
3. sees a scaling action appear in the decision log within 5 s of happening: the budget is cut
   below the fleet's cost through the API, which records a ``budget_drain`` decision (and the
   reconciler drains an instance);
   It stays on the app it shows when an app that sorts first (and has a long name) is
   registered;
4. reads well at 1200, 1280 and 1920 px (three columns), at 1101 and 1180 px (two) and at 400 px
   wide (one column, no sideways scroll, that long name in the app select);
5. drops an address's bad app and window and draws the default app; when the app on screen is
   deleted, clears the page and says so, without moving to another app;
6. signs out, after which the data route answers 401, and another tab's form says why.

Skipped when ``/usr/bin/chromium`` (``apt-get install chromium``; ``.ci/run`` does) or the
``playwright`` package is missing. Playwright's own browser downloads are never used.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from controlplane.db.store import Store
from controlplane.settings import Settings
from tests.integration.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
START_DEADLINE_S = 60.0
STOP_DEADLINE_S = 30.0
# The reconciler runs in the loops process, which starts beside the serving process and may
# still be importing when the serving process answers (seconds, more on a busy machine).
FLEET_DEADLINE_S = START_DEADLINE_S + 60.0
# The acceptance: a scaling action is on the page within 5 s of happening.
DECISION_DEADLINE_MS = 5_000
DRAW_DEADLINE_MS = 15_000
DRAWN = re.compile(r"^(ready|partial)$")
GEAR_SWITCHES = 12
PANELS = ("fleet", "instances", "cost", "load", "latency", "cascade", "decisions", "plan")

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason=f"no {CHROMIUM} (apt-get install chromium; .ci/run does)"
)
sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
expect = sync_api.expect

# Latency shapes of the toy app (as tests/component/test_api.py): planning takes milliseconds.
SHAPES = {"g4dn.xlarge": (3.0, 1.0), "r5n.large": (8.0, 4.0), "t3.xlarge": (12.0, 6.0)}
BATCHES = (1, 2, 4, 8, 16)
TOY = {
    "name": "toy",
    "models": [{"name": "m", "profiles": "profiles.csv"}],
    "slo": {"latency_ms": 40.0},
    "budget_usd_per_hr": 4.0,
    "instance_types": ["g4dn.xlarge", "r5n.large", "t3.xlarge"],
}
# An app registered while the page is open: it sorts before "toy" (the data route's default is
# the first app by name) and its name is long (63 characters at most).
LONG_APP = "a-tenant-01-recommendation-ranking-service-production-eu-west"


def dollars(value: float) -> str:
    """The page's whole dollars ("$96") and dollars with cents ("$6.31")."""
    return f"${value:.0f}" if abs(value - round(value)) < 0.005 else f"${value:.2f}"


def write_profiles(folder: Path) -> None:
    rows = ["model,instance_type,batch_size,sample,infer_ms,load_ms"]
    for itype, (fixed, slope) in SHAPES.items():
        for b in BATCHES:
            rows += [
                f"m,{itype},{b},{i},{(fixed + slope * b) * (0.9 + 0.02 * i):.4f},0"
                for i in range(11)
            ]
    (folder / "profiles.csv").write_text("\n".join(rows) + "\n")


@dataclass
class Service:
    url: str
    store: Store
    tokens: dict[str, str]
    process: subprocess.Popen[bytes]
    log: Path

    def api(self, scope: str = "admin") -> httpx.Client:
        return httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {self.tokens[scope]}"},
            timeout=60.0,
        )


def _wait_ready(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        try:
            code = process.wait(timeout=0.2)  # the pause between polls; catches an early exit
        except subprocess.TimeoutExpired:
            continue
        pytest.fail(f"serve exited with {code}:\n{log.read_text()}")
    pytest.fail(f"serve not ready in {START_DEADLINE_S} s:\n{log.read_text()}")


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    write_profiles(data_dir)
    store = Store.from_url(Settings(data_dir=data_dir).database_url, upgrade=True)
    tokens = {scope: store.create_token(scope, name=scope) for scope in ("admin", "viewer")}
    tokens["infer"] = store.create_token("infer", name="client")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETEROPLANE_")}
    env |= {
        "HETEROPLANE_DATA_DIR": str(data_dir),
        "HETEROPLANE_PROVISIONER": "fake",
        "HETEROPLANE_RECONCILE_S": "1",
        "HETEROPLANE_ROLLUP_S": "1",
    }
    log = tmp_path / "serve.log"
    with log.open("ab") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "controlplane", "serve", "--port", str(port)],
            cwd=REPO,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, process, log)
        yield Service(url, store, tokens, process, log)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=STOP_DEADLINE_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        store.close()
    assert process.returncode == 0, log.read_text()


def prepare(service: Service) -> dict[str, Any]:
    """Register the toy app, plan and apply it, wait for the reconciler to launch the plan's
    fleet, and add five minutes of samples with load, latency, gears and accuracy."""
    with service.api() as api:
        created = api.post("/v1/apps", json=TOY)
        assert created.status_code == 201, created.text
        plan = api.post("/v1/apps/toy/plans", json={"rate_qps": 100.0})
        assert plan.status_code == 201, plan.text
        applied = api.post(f"/v1/apps/toy/plans/{plan.json()['id']}/apply")
        assert applied.status_code == 200, applied.text
        deadline = time.monotonic() + FLEET_DEADLINE_S
        fleet: dict[str, Any] = {}
        while time.monotonic() < deadline:
            fleet = api.get("/v1/apps/toy/fleet").json()
            if fleet["instances"] and all(
                row["states"].get("running") == row["count"] for row in fleet["by_type"]
            ):
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the reconciler launched no fleet: {fleet}\n{service.log.read_text()}")
    # A burst of gear switches after the plan: one entry in the log, the plan's still in view.
    for i in range(GEAR_SWITCHES):
        service.store.record_decision(
            "toy", "gear_switch", f"gear {i % 2}", {"gear": "fast" if i % 2 else "accurate"}
        )
    now = datetime.now(UTC)
    for i in range(30):
        at = now - timedelta(seconds=300 - 10 * i)
        surge = 10 <= i < 20
        service.store.add_metric_sample(
            "toy",
            arrival_rate_qps=120.0 if surge else 80.0,
            fleet_cost_usd_per_hr=fleet["cost_usd_per_hr"],
            latency_p50_ms=12.0 + i % 3,
            latency_p95_ms=24.0 + i % 4,
            latency_p99_ms=(44.0 if surge else 31.0) + i % 5,
            attainment_share=0.97 if surge else 0.995,
            gear="fast" if surge else "accurate",
            accuracy=0.95 if surge else 0.97,
            at=at,
        )
    return fleet


def launch(profile: Path, playwright: Any, width: int = 1280, height: int = 800) -> Any:
    return playwright.chromium.launch_persistent_context(
        str(profile),
        executable_path=str(CHROMIUM),
        headless=True,
        args=CHROMIUM_ARGS,
        viewport={"width": width, "height": height},
    )


def sign_in(page: Any, url: str, token: str) -> int:
    """Submit the sign-in form with ``token``; the status of the form's answer."""
    page.goto(f"{url}/dashboard")
    page.fill("#token", token)
    with page.expect_response(lambda r: r.url.endswith("/dashboard/login")) as answer:
        page.click("#login-button")
    status: int = answer.value.status
    return status


def assert_wide_layout(page: Any, width: int) -> None:
    """Three columns of panels within ``width`` from 1200 px, two below; every instance in the
    table, no row taller than a line for its id and no column behind a sideways scroll (a
    cascade worker's models cell in it too); no tile's text cut."""
    page.wait_for_function(
        "(w) => document.getElementById('panel-load').getBoundingClientRect().right <= w",
        arg=width,
    )
    fleet_box = page.locator("#panel-fleet").bounding_box()
    cost_box = page.locator("#panel-cost").bounding_box()
    load_box = page.locator("#panel-load").bounding_box()
    if width >= 1200:
        assert fleet_box["y"] == cost_box["y"] == load_box["y"], width
    else:
        assert fleet_box["y"] == cost_box["y"] < load_box["y"], width
    assert load_box["x"] + load_box["width"] <= width
    assert page.evaluate("document.documentElement.scrollWidth") <= width
    table = page.locator("#instance-table").evaluate(
        """(t) => {
          const wrap = t.parentElement;
          return {
            width: t.scrollWidth, room: wrap.clientWidth,
            cols: Array.from(t.querySelectorAll("thead th"))
              .map((h) => Math.round(h.getBoundingClientRect().width)),
            height: wrap.scrollHeight, shown: wrap.clientHeight,
            idLines: Array.from(t.querySelectorAll("tbody td:last-child code"))
              .map((c) => c.getClientRects().length),
          };
        }"""
    )
    assert table["width"] <= table["room"] + 1, (width, table)
    # A cascade's worker lists each model with its state: the widest models cell the demo shows,
    # put in a row and measured at once (the page draws again every few seconds).
    cascade = page.locator("#instance-table").evaluate(
        """(t) => {
          const cell = t.querySelector("tbody tr td:nth-child(6)");
          const before = cell.textContent;
          cell.textContent = "tiny: active, medium: overloaded, large: interfered";
          const fits = { width: t.scrollWidth, room: t.parentElement.clientWidth };
          cell.textContent = before;
          return fits;
        }"""
    )
    assert cascade["width"] <= cascade["room"] + 1, (width, cascade)
    assert table["height"] <= table["shown"] + 1, (width, table)  # every row, no inner scroll
    assert table["idLines"] and set(table["idLines"]) == {1}, (width, table)
    cut = page.locator(".tile .s, .tile .v").evaluate_all(
        "(nodes) => nodes.filter((n) => n.scrollWidth > n.clientWidth + 1)"
        ".map((n) => n.closest('.tile').id + ': ' + n.textContent)"
    )
    assert not cut, (width, cut)


def test_the_dashboard_in_a_browser(service: Service, tmp_path: Path) -> None:
    fleet = prepare(service)
    profile = tmp_path / "chromium"
    profile.mkdir()
    with sync_api.sync_playwright() as playwright:
        context = launch(profile, playwright)
        try:
            page = context.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda error: errors.append(str(error)))

            # 1. Refused: a wrong token, then a token without the viewer scope.
            assert sign_in(page, service.url, "hp_not-a-token-of-ours") == 401
            expect(page.locator("#login-message")).to_contain_text("not valid")
            expect(page.locator("#token")).to_be_visible()
            assert not [c for c in context.cookies() if c["name"] == "heteroplane_dashboard"]
            assert sign_in(page, service.url, service.tokens["infer"]) == 403
            expect(page.locator("#login-message")).to_contain_text("needs viewer")

            # 2. Signed in: every panel draws from the service's data.
            assert sign_in(page, service.url, service.tokens["viewer"]) == 303
            (cookie,) = [c for c in context.cookies() if c["name"] == "heteroplane_dashboard"]
            assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
            expect(page.locator("#viewer")).to_have_text(
                "viewer (viewer)", timeout=DRAW_DEADLINE_MS
            )
            for panel in PANELS:
                # The instances' utilisation and model states come from the workers: "partial"
                # until the serving path reports them.
                expect(page.locator(f'[data-panel="{panel}"]')).to_have_attribute(
                    "data-state", DRAWN, timeout=DRAW_DEADLINE_MS
                )
            types = sorted(row["instance_type"] for row in fleet["by_type"])
            for instance_type in types:
                expect(
                    page.locator(f'#fleet-chart path[data-series="{instance_type}"]')
                ).to_have_count(1)
            expect(page.locator("#instance-table tbody tr")).to_have_count(fleet["instances"])
            expect(page.locator('#cost-chart path[data-series="fleet cost"]')).to_have_count(1)
            expect(page.locator('#cost-chart path[data-series="budget"]')).to_have_count(1)
            expect(page.locator("#cost-figures dd")).to_have_count(6)
            expect(page.locator('#load-chart path[data-series="arrival rate"]')).to_have_count(1)
            expect(page.locator('#load-chart path[data-series="capacity"]')).to_have_count(1)
            for series in ("P50", "P99"):
                expect(page.locator(f'#latency-chart path[data-series="{series}"]')).to_have_count(
                    1
                )
            expect(page.locator('#attainment-chart path[data-series="attainment"]')).to_have_count(
                1
            )
            expect(page.locator('#gear-chart rect[data-series="fast"]')).not_to_have_count(0)
            expect(page.locator('#accuracy-chart path[data-series="accuracy"]')).to_have_count(1)
            expect(page.locator('#decision-log li[data-kind="plan_applied"]')).to_have_count(1)
            switches = page.locator('#decision-log li[data-kind="gear_switch"]')
            expect(switches).to_have_count(1)
            expect(switches).to_have_attribute("data-run", str(GEAR_SWITCHES))
            expect(switches).to_contain_text(f"x{GEAR_SWITCHES}")
            expect(page.locator("#plan-body")).to_contain_text("feasible")
            expect(page.locator("#plan-ranking table").first).to_be_visible()
            expect(page.locator("#tile-latency .v")).not_to_have_text("–")
            # The page pins the app it drew (the address says so) ...
            expect(page).to_have_url(re.compile(r"/dashboard\?app=toy$"))
            expect(page.locator("#tile-forecast .s")).to_have_text(
                f"of {dollars(TOY['budget_usd_per_hr'] * 24)} at budget"
            )

            # 3. A scaling action: the budget cut below the fleet's cost drains an instance.
            with service.api("admin") as api:
                cut = api.put(
                    "/v1/apps/toy/budget",
                    json={"budget_usd_per_hr": fleet["cost_usd_per_hr"] / 2, "reason": "test"},
                )
                happened = time.monotonic()
                assert cut.status_code == 200, cut.text
                assert cut.json()["drain"], cut.json()
            drained = page.locator('#decision-log li[data-kind="budget_drain"]')
            expect(drained).to_have_count(1, timeout=DECISION_DEADLINE_MS)
            assert time.monotonic() - happened <= DECISION_DEADLINE_MS / 1000
            expect(drained).to_contain_text("budget lowered")
            # A decision's figures may be cut to the panel: each one's whole text is its tooltip.
            figures = page.locator("#decision-log .numbers span").evaluate_all(
                "(spans) => spans.map((s) => [s.title, s.textContent])"
            )
            assert figures and all(title == text for title, text in figures), figures
            # Newest first (the reconciler adds its own decisions as it drains).
            shown = [int(i) for i in page.locator("#decision-log li").evaluate_all(
                "(items) => items.map((item) => item.dataset.decisionId)"
            )]  # fmt: skip
            assert shown == sorted(shown, reverse=True) and len(shown) >= 2
            # The day's budget with its cents.
            expect(page.locator("#tile-forecast .s")).to_have_text(
                f"of {dollars(fleet['cost_usd_per_hr'] / 2 * 24)} at budget"
            )

            # ... and stays on it when an app that sorts first is registered.
            with service.api("admin") as api:
                created = api.post("/v1/apps", json=TOY | {"name": LONG_APP})
                assert created.status_code == 201, created.text
            expect(page.locator("#app-select option")).to_have_count(2)
            expect(page.locator("#app-select")).to_have_value("toy")
            expect(page.locator("#plan-body")).to_contain_text("feasible")
            expect(page).to_have_url(re.compile(r"/dashboard\?app=toy$"))

            # 4. Readable in two columns at 1101 and 1180 px, in three from 1200 px (a cascade
            # worker's models cell in the instance table too) and on a narrow screen (one column).
            for width, height in ((1101, 800), (1180, 800), (1200, 800), (1280, 800), (1920, 1080)):
                page.set_viewport_size({"width": width, "height": height})
                assert_wide_layout(page, width)
            page.set_viewport_size({"width": 400, "height": 800})
            expect(page.locator("#panel-cost")).to_be_visible()
            page.wait_for_function(
                "() => document.getElementById('panel-cost').getBoundingClientRect().top >"
                " document.getElementById('panel-fleet').getBoundingClientRect().bottom"
            )
            assert page.evaluate("document.documentElement.scrollWidth") <= 400
            assert not errors, errors
            page.set_viewport_size({"width": 1280, "height": 800})
            # A flat accuracy of 1.0 under the fixed top of 100%: the bottom drops instead.
            labels = page.evaluate(
                """() => {
                  const box = document.createElement("div");
                  document.body.appendChild(box);
                  window.HPCharts.time(box, { t0: 0, t1: 60, yMax: 1, yFormat: (v) => v,
                    series: [{ label: "accuracy", t: [0, 30, 60], v: [1, 1, 1] }] });
                  const shown = Array.from(
                    box.querySelectorAll(".grid text"), (n) => +n.textContent);
                  box.remove();
                  return shown;
                }"""
            )
            assert labels and max(labels) == 1 and min(labels) < 1, labels

            # 5. A bad app and window in the address: dropped (the window clamped to the
            # choices), said once, and the first app drawn.
            page.goto(f"{service.url}/dashboard?app=Toy&window_s=30")
            expect(page.locator("#banner")).to_contain_text("'Toy'")
            expect(page.locator("#banner")).to_contain_text("5 min")
            expect(page.locator('[data-panel="plan"] .empty')).to_contain_text(LONG_APP)
            expect(page.locator("#window-select")).to_have_value("300")
            expect(page).to_have_url(f"{service.url}/dashboard?app={LONG_APP}&window_s=300")
            page.select_option("#app-select", "toy")
            expect(page.locator("#plan-body")).to_contain_text("feasible")
            expect(page.locator("#banner")).to_be_hidden()
            expect(page).to_have_url(re.compile(r"/dashboard\?app=toy&window_s=300$"))
            # The app on screen deleted: the page says so and keeps nothing of it, and does not
            # move to the other app until the operator picks it.
            with service.api("admin") as api:
                deleted = api.delete("/v1/apps/toy", params={"force": "true"})
                assert deleted.status_code == 204, deleted.text
            expect(page.locator("#banner")).to_contain_text("'toy' is gone")
            expect(page.locator("#app-select")).to_have_value("")
            for panel in PANELS:
                expect(page.locator(f'[data-panel="{panel}"]')).to_have_attribute(
                    "data-state", "empty"
                )
            assert page.locator(".tile .v").all_text_contents() == ["–"] * 8
            for cleared in ("#instance-table tbody tr", "#decision-log li", "#plan-body *",
                            ".chart svg"):  # fmt: skip
                expect(page.locator(cleared)).to_have_count(0)
            expect(page).to_have_url(re.compile(r"/dashboard\?app=toy&window_s=300$"))
            # Registered again under its name: the page shows it again (the new app, no plan).
            with service.api("admin") as api:
                created = api.post("/v1/apps", json=TOY)
                assert created.status_code == 201, created.text
            expect(page.locator('[data-panel="plan"] .empty')).to_contain_text("/v1/apps/toy/")
            expect(page.locator("#app-select")).to_have_value("toy")
            expect(page.locator("#banner")).to_be_hidden()
            assert not errors, errors

            # 6. Signed out: the form again, and the data route refuses the browser; another
            # tab's next poll finds the sign-in ended and its form says so, keeping its app.
            other = context.new_page()
            other.goto(f"{service.url}/dashboard?app={LONG_APP}")
            expect(other.locator('[data-panel="plan"]')).to_have_attribute("data-state", "empty")
            page.click("#logout-button")
            expect(page.locator("#token")).to_be_visible()
            status = page.evaluate("fetch('/dashboard/data').then((r) => r.status)")
            assert status == 401
            expect(other.locator("#login-message")).to_contain_text("sign-in has ended")
            expect(other.locator("#login-form")).to_have_attribute(
                "action", f"/dashboard/login?app={LONG_APP}"
            )
        finally:
            context.close()
