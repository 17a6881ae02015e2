"""The spot price knob of the fake and the local provisioner (``SpotPriceBoard``): what their
``spot_price`` answers, as the EC2 provisioner's DescribeSpotPriceHistory read does, so that the
reconciler's rule 10 and the spot re-planner run on moved prices in tests and in the demo."""

from __future__ import annotations

from pathlib import Path

import pytest

from provisioners.fake import FakeProvisioner
from provisioners.interruptions import SpotPriceBoard, SpotPriceSource
from provisioners.local import LocalProvisioner


def test_a_price_set_is_answered_until_it_is_unset() -> None:
    board = SpotPriceBoard()
    assert board.get("t3.large") is None
    board.set("t3.large", 0.03)
    assert board.get("t3.large") == 0.03
    board.set("t3.large", None)
    assert board.get("t3.large") is None


@pytest.mark.parametrize("price", [-0.01, float("nan"), float("inf")])
def test_a_price_that_is_no_price_is_refused(price: float) -> None:
    with pytest.raises(ValueError, match="finite and >= 0"):
        SpotPriceBoard().set("t3.large", price)


def test_the_fake_and_the_local_provisioner_answer_the_prices_set(tmp_path: Path) -> None:
    fake = FakeProvisioner()
    local = LocalProvisioner(tmp_path / "state", {"emu.cpu.small": 1.0}, ["tiny"], None)
    try:
        for provisioner in (fake, local):
            assert isinstance(provisioner, SpotPriceSource)
            assert provisioner.spot_price("emu.cpu.small") is None  # the catalog's serves
            provisioner.set_spot_price("emu.cpu.small", 0.02)
            assert provisioner.spot_price("emu.cpu.small") == 0.02
    finally:
        local.close()
