"""A plan the service makes for an app that buys spot is made at the provider's spot prices
where the provider reads them (the EC2 provisioner: DescribeSpotPriceHistory), the catalog's
otherwise, and says which (docs/spot.md): the API over the real store, a provisioner that reads
prices (the fake one with a price list, as the EC2 one answers ``spot_price``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from controlplane.service.app import create_app
from provisioners.base import Provisioner
from provisioners.fake import FakeProvisioner
from tests.component.test_api import service_parts, spec


class PricedProvisioner(FakeProvisioner):
    """The fake provisioner with spot prices now (its own knob, as the EC2 one reads them),
    recording the types asked for."""

    def __init__(self, prices: dict[str, float]) -> None:
        super().__init__(running_on_launch=True)
        for instance_type, price in prices.items():
            self.set_spot_price(instance_type, price)
        self.asked: list[str] = []

    def spot_price(self, instance_type: str) -> float | None:
        self.asked.append(instance_type)
        return super().spot_price(instance_type)


def _preview(tmp_path: Path, provisioner: Provisioner) -> dict[str, Any]:
    _, settings, clock, store = service_parts(tmp_path)
    token = {"Authorization": f"Bearer {store.create_token('admin', name='t')}"}
    app = create_app(settings, store, clock, provisioner=provisioner)
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            body = {**spec(), "spot": {"enabled": True, "survive_share": 0.2}}
            assert client.post("/v1/apps", json=body, headers=token).status_code == 201
            response = client.post("/v1/apps/toy/plans", json={"rate_qps": 100.0}, headers=token)
            assert response.status_code == 201, response.text
            plan: dict[str, Any] = response.json()
            return plan
    finally:
        store.close()


def test_a_service_plan_is_made_at_the_providers_spot_prices(tmp_path: Path) -> None:
    # The provider sells g4dn.xlarge on spot at 0.06 and the others at their on-demand prices
    # (no cheaper on spot than on demand: they stay on demand).
    on_demand = {"r5n.large": 0.149, "t3.xlarge": 0.1664}
    provider = PricedProvisioner({"g4dn.xlarge": 0.06, **on_demand})
    plan = _preview(tmp_path, provider)
    assert sorted(set(provider.asked)) == ["g4dn.xlarge", "r5n.large", "t3.xlarge"]
    assert plan["spot_prices_source"] == "provider"
    assert plan["spot_prices_usd_per_hr"] == {"g4dn.xlarge": 0.06, **on_demand}
    spot = {t for stage in plan["stages"] for t in stage["spot_fleet"]}
    assert spot <= {"g4dn.xlarge"}
    assert any("spot prices from the provider" in step for step in plan["steps"])


def test_without_a_provider_that_reads_prices_the_catalogs_serve(tmp_path: Path) -> None:
    plan = _preview(tmp_path, FakeProvisioner(running_on_launch=True))
    assert plan["spot_prices_source"] == "catalog"
    assert plan["spot_prices_usd_per_hr"]["r5n.large"] < 0.149  # the catalog's discount
