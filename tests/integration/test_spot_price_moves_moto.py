"""The hard cap when spot prices move, on a real moto server: the reconciler (real store through
the migrations, fake clock) over the EC2 provisioner, whose spot prices are read with
DescribeSpotPriceHistory (cached for the TTL) and raised mid-run in steps. A rise into the
headroom below the budget moves the capacity before the budget is breached; the fleet's cost at
the prices now stays within the budget at every tick, and the decisions say why."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.moto_server import (
    Ec2Network,
    aws_env,
    ec2_network,
    moto_server,
    needs_moto,
)

__all__ = ["aws_env", "ec2_network", "moto_server"]  # fixtures, imported for pytest

pytestmark = needs_moto

boto3 = pytest.importorskip("boto3")

from tests.integration.test_spot_moto import (  # noqa: E402
    reconciler_on_moto,
    serve_two_spot_t3_large,
)

_LIVE = ("requested", "pending", "running", "draining")


def test_a_spot_price_raised_mid_run_on_ec2_is_acted_on_before_it_breaches_the_budget(
    ec2_network: Ec2Network, tmp_path: Any
) -> None:
    types = ["t3.large", "t3.xlarge"]
    board, clock, store, reconciler = reconciler_on_moto(
        ec2_network, tmp_path, {"t3.large": 0.03, "t3.xlarge": 0.05}
    )
    budget = 0.12  # the move starts past 0.108 (the default headroom: a tenth)

    def tick(seconds: float = 1.0) -> None:
        clock.advance(seconds)
        reconciler.run_once()
        prices = board.prices or {}
        live = store.list_instances("recs", states=list(_LIVE))
        paid = sum(
            prices[r.instance_type] if r.market == "spot" else r.price_usd_per_hr for r in live
        )
        assert paid <= budget + 1e-9, (paid, prices)

    try:
        serve_two_spot_t3_large(store, clock, reconciler, budget, types)
        tick()
        # A first step up (2 x 0.05 = 0.1): within the headroom, nothing moves.
        board.prices = {"t3.large": 0.05, "t3.xlarge": 0.05}
        tick(61.0)  # past the price cache's TTL
        assert not store.list_decisions("recs", kinds=["terminate"])

        # A second (2 x 0.056 = 0.112): within the budget, past the headroom. The two t3.large
        # go and two t3.xlarge on spot (0.05 each: no less capacity, for less) launch in the
        # same tick, before any breach.
        board.prices = {"t3.large": 0.056, "t3.xlarge": 0.05}
        tick(61.0)
        kept = store.list_instances("recs", states=["requested", "pending", "running"])
        assert sorted((r.instance_type, r.market) for r in kept) == [("t3.xlarge", "spot")] * 2
        (moved,) = store.list_decisions("recs", kinds=["terminate"])
        assert moved.numbers["cause"] == "spot_price"
        assert "rose to 0.056" in moved.reason and "less its headroom" in moved.reason
        price = store.list_decisions("recs", kinds=["spot_price"])[-1]
        assert "before the budget is breached" in price.reason
        stand_ins = store.list_decisions("recs", kinds=["stand_in"])
        assert [d.numbers["stands_for"] for d in stand_ins] == ["t3.large"] * 2

        # The rise goes on to on demand: nothing is left to pay for at it.
        board.prices = {"t3.large": 0.0832, "t3.xlarge": 0.05}
        tick(61.0)
        for _ in range(3):
            tick()
        running = store.list_instances("recs", states=["running"])
        assert sorted(r.instance_type for r in running) == ["t3.xlarge", "t3.xlarge"]
    finally:
        store.close()
