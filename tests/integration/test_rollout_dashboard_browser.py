"""The dashboard's rollout panel in a real browser (Debian's headless Chromium, Playwright),
against a real ``heteroplane serve`` process (the fixture of test_dashboard_browser.py).

A rollout of the toy app is written to the service's database as its loop leaves one that
rolled back (state, reason, per-version figures of the step judged); the signed-in viewer sees
the panel draw it: the state, the versions and the step, the reason, a row of figures per
version (queries, errors, P99, agreement). An app without a rollout shows the panel empty with
what to run.
"""

from __future__ import annotations

from pathlib import Path

from tests.integration.test_dashboard_browser import (
    DRAW_DEADLINE_MS,
    TOY,
    Service,
    expect,
    launch,
    pytestmark,
    service,
    sign_in,
    sync_api,
)

# The fixture, imported for this module's tests, and the skip without Chromium (the service the
# fixture starts is not started for a browser that is not there).
__all__ = ["pytestmark", "service"]


def test_the_rollout_panel_shows_state_and_figures_by_version(
    service: Service, tmp_path: Path
) -> None:
    with service.api() as api:
        created = api.post("/v1/apps", json=TOY)
        assert created.status_code == 201, created.text
    profile = tmp_path / "chromium"
    profile.mkdir()
    with sync_api.sync_playwright() as playwright:
        context = launch(profile, playwright)
        try:
            page = context.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda error: errors.append(str(error)))
            assert sign_in(page, service.url, service.tokens["viewer"]) == 303
            panel = page.locator('[data-panel="rollout"]')
            expect(panel).to_have_attribute("data-state", "empty", timeout=DRAW_DEADLINE_MS)
            expect(panel).to_contain_text("heteroplane rollout start --app toy")

            rollouts = service.store
            started = rollouts.create_rollout(
                "toy",
                model="m",
                artifact="toy-model",
                from_version=1,
                to_version=2,
                settings={
                    "steps": [0.0, 0.25, 1.0],
                    "interval_s": 60.0,
                    "shadow": True,
                    "thresholds": {"min_agreement_share": 0.95},
                    "extra_fleet": {"t3.xlarge": 1},
                },
                reason="started by test",
                who="test",
            )
            figures = {
                "versions": {
                    "toy-model@1": {"queries": 120, "errors": 0, "p99_ms": 31.5},
                    "toy-model@2": {
                        "queries": 120,
                        "errors": 1,
                        "p99_ms": 36.4,
                        "compared": 118,
                        "agreed": 59,
                        "agreement_share": 0.5,
                    },
                }
            }
            rollouts.move_rollout(
                started,
                state="rolled_back",
                figures=figures,
                reason="rolled back at step 1 (shadow): agreement with the old version 0.500",
            )
            expect(panel).to_have_attribute("data-state", "ready", timeout=DRAW_DEADLINE_MS)
            expect(page.locator("#rollout-title")).to_have_text(f"#{started.id}")
            expect(panel.locator(".rollout-state")).to_have_text("rolled back")
            expect(panel).to_contain_text("m: toy-model@1 → @2")
            expect(panel).to_contain_text("agreement with the old version 0.500")
            rows = panel.locator("tbody tr")
            expect(rows).to_have_count(2)
            expect(rows.nth(0)).to_contain_text("toy-model@1")
            expect(rows.nth(1)).to_contain_text("36.4 ms")
            expect(rows.nth(1)).to_contain_text("50.0% of 118")
            assert not errors, errors
        finally:
            context.close()
