"""Spot on EC2 against a real moto server (boto3 over HTTP): spot prices read with
DescribeSpotPriceHistory and cached per zone; interruption, rebalance and state-change messages on
the SQS queue turned into notices by the EC2 provisioner; the reconciler over it when spot prices
rise mid-run (the cap held at every tick, the capacity moved before a breach)."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tests.integration.moto_server import (
    REGION,
    ZONES,
    Ec2Network,
    aws_env,
    ec2_network,
    moto_server,
    needs_moto,
)

__all__ = ["aws_env", "ec2_network", "moto_server"]  # fixtures, imported for pytest

pytestmark = needs_moto

boto3 = pytest.importorskip("boto3")
from botocore.awsrequest import AWSResponse  # noqa: E402

from provisioners.ec2 import Ec2Config, Ec2Provisioner  # noqa: E402
from provisioners.interruptions import INTERRUPTION_NOTICE_S, MARKET_TAG  # noqa: E402
from provisioners.spot import SpotPriceReader  # noqa: E402


def ec2_config(network: Ec2Network, **changes: Any) -> Ec2Config:
    return Ec2Config(region=REGION, subnet_ids=network.subnet_ids, ami_id=network.ami_id, **changes)


class _Body:
    def __init__(self, data: bytes) -> None:
        self._data = data

    def stream(self, **_: Any) -> Any:
        yield self._data


class PriceBoard:
    """A ``before-send`` hook on DescribeSpotPriceHistory: counts the calls and, once ``prices``
    is set, answers with them (type -> USD/hr, the same in every zone) as EC2 would."""

    def __init__(self) -> None:
        self.calls = 0
        self.prices: dict[str, float] | None = None

    def __call__(self, request: Any, **_: Any) -> AWSResponse | None:
        self.calls += 1
        if self.prices is None:
            return None  # moto answers
        items = "".join(
            f"<item><instanceType>{t}</instanceType><productDescription>Linux/UNIX"
            f"</productDescription><spotPrice>{p}</spotPrice><timestamp>"
            f"2026-11-28T10:00:00.000Z</timestamp><availabilityZone>{zone}</availabilityZone>"
            "</item>"
            for t, p in self.prices.items()
            for zone in ZONES
        )
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n<DescribeSpotPriceHistoryResponse'
            ' xmlns="http://ec2.amazonaws.com/doc/2016-11-15/"><requestId>injected</requestId>'
            f"<spotPriceHistorySet>{items}</spotPriceHistorySet><nextToken/>"
            "</DescribeSpotPriceHistoryResponse>"
        ).encode()
        return AWSResponse(request.url, 200, {"Content-Type": "text/xml"}, _Body(body))


def reconciler_on_moto(
    ec2_network: Ec2Network, tmp_path: Any, prices: dict[str, float]
) -> tuple[PriceBoard, Any, Any, Any]:
    """A reconciler (real store through the migrations, fake clock) over the EC2 provisioner on
    moto, whose DescribeSpotPriceHistory answers ``prices`` (a board to change them; cached 60
    s), with launch templates for those types."""
    from controlplane.clock import FakeClock
    from controlplane.db import migrate
    from controlplane.db.store import Store
    from controlplane.loops.reconciler import Reconciler, catalog_pricing
    from estimator.catalog import default_catalog

    board = PriceBoard()
    board.prices = dict(prices)
    session = boto3.Session()
    session.events.register("before-send.ec2.DescribeSpotPriceHistory", board)
    clock = FakeClock(start_utc=datetime.now(UTC).replace(microsecond=0))
    templates = Ec2Provisioner(ec2_config(ec2_network)).ensure_launch_templates(sorted(prices))
    provisioner = Ec2Provisioner(
        ec2_config(ec2_network, launch_templates=templates, spot_price_ttl_s=60.0),
        session,
        clock=clock.now_s,
    )
    database = f"sqlite:///{tmp_path / 'heteroplane.db'}"
    migrate.upgrade(database)
    store = Store.from_url(database, clock)
    return (
        board,
        clock,
        store,
        Reconciler(store, provisioner, clock, catalog_pricing(default_catalog())),
    )


def planned_recs(
    store: Any, budget: float, types: list[str], cost: float, stage: dict[str, Any]
) -> None:
    """Register the app ``recs`` (``types`` its candidates, ``budget``) and apply a plan of the
    one stage ``stage`` (its fleets) costing ``cost``."""
    store.create_app(
        {
            "name": "recs",
            "models": [{"name": "tiny", "profiles": "profiles.json"}],
            "slo": {"latency_ms": 50},
            "budget_usd_per_hr": budget,
            "instance_types": types,
        },
        who="test",
    )
    document = {"feasible": True, "cost_usd_per_hr": cost, "stages": [{"name": "tiny", **stage}]}
    store.apply_plan("recs", store.create_plan("recs", document).id)


def serve_two_spot_t3_large(
    store: Any, clock: Any, reconciler: Any, budget: float, types: list[str]
) -> None:
    """Register the app (``types`` its candidates), apply a plan of two t3.large on spot and
    reconcile three ticks (they launch and run)."""
    two = {"t3.large": 2}
    planned_recs(store, budget, types, 0.06, {"fleet": two, "spot_fleet": two})
    for _ in range(3):
        clock.advance(1.0)
        reconciler.run_once()


def test_spot_prices_are_read_per_zone_and_cached_for_the_ttl(aws_env: str) -> None:
    board = PriceBoard()
    session = boto3.Session()
    session.events.register("before-send.ec2.DescribeSpotPriceHistory", board)
    now = [0.0]
    reader = SpotPriceReader(
        session.client("ec2", region_name=REGION), ttl_s=300.0, clock=lambda: now[0]
    )

    # moto's own answer: every zone of the region that offers the type, at its stock price.
    read = reader.prices(["g4dn.xlarge", "c5.xlarge"])
    assert {zone for (_, zone) in read} >= set(ZONES)
    assert {t for (t, _) in read} == {"g4dn.xlarge", "c5.xlarge"}
    assert board.calls == 1

    # Within the TTL: from the cache, however often it is asked.
    board.prices = {"g4dn.xlarge": 0.9, "c5.xlarge": 0.1}
    now[0] = 299.0
    assert reader.price("g4dn.xlarge", ZONES[0]) == read[("g4dn.xlarge", ZONES[0])]
    reader.prices(["g4dn.xlarge"])
    assert board.calls == 1

    # Past it: read again, and the raised price is what is answered, in every zone.
    now[0] = 301.0
    assert reader.price("g4dn.xlarge", ZONES[1]) == 0.9
    assert reader.price("g4dn.xlarge") == 0.9
    assert board.calls == 2
    assert reader.price("p3.2xlarge", "nowhere-1z") is None


def _event(detail_type: str, instance_id: str, at: datetime, **detail: str) -> str:
    return json.dumps(
        {
            "version": "0",
            "id": f"e-{instance_id}-{detail_type[:8]}",
            "detail-type": detail_type,
            "source": "aws.ec2",
            "account": "123456789012",
            "time": at.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "region": REGION,
            "resources": [f"arn:aws:ec2:{REGION}:123456789012:instance/{instance_id}"],
            "detail": {"instance-id": instance_id, **detail},
        }
    )


def test_queue_messages_become_interruption_notices(ec2_network: Ec2Network) -> None:
    sqs = boto3.client("sqs", region_name=REGION)
    queue_url = sqs.create_queue(QueueName="heteroplane-interruptions")["QueueUrl"]
    at = datetime(2026, 11, 28, 10, 0, tzinfo=UTC)
    bodies = [
        _event(
            "EC2 Spot Instance Interruption Warning", "i-a", at, **{"instance-action": "terminate"}
        ),
        _event("EC2 Instance Rebalance Recommendation", "i-b", at + timedelta(seconds=1)),
        _event(
            "EC2 Instance State-change Notification",
            "i-c",
            at + timedelta(seconds=2),
            state="shutting-down",
        ),
        _event("EC2 Instance State-change Notification", "i-d", at, state="running"),  # no notice
        "not json at all",
        json.dumps({"detail-type": "AWS Health Event", "detail": {}}),
    ]
    for body in bodies:
        sqs.send_message(QueueUrl=queue_url, MessageBody=body)
    provisioner = Ec2Provisioner(ec2_config(ec2_network, interruption_queue_url=queue_url))

    notices = provisioner.poll_interruptions()

    assert [(n.kind, n.provider_id) for n in notices] == [
        ("interruption", "i-a"),
        ("rebalance", "i-b"),
        ("state_change", "i-c"),
    ]
    assert notices[0].deadline == at + timedelta(seconds=INTERRUPTION_NOTICE_S)
    assert notices[2].deadline == notices[2].at and notices[2].state == "shutting-down"
    # Every message was deleted once read (the two that are no notice too): the queue is empty,
    # and the next poll says nothing again.
    assert provisioner.poll_interruptions() == []
    attributes = sqs.get_queue_attributes(
        QueueUrl=queue_url,
        AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
    )["Attributes"]
    assert attributes == {
        "ApproximateNumberOfMessages": "0",
        "ApproximateNumberOfMessagesNotVisible": "0",
    }


def test_without_a_queue_there_are_no_notices(ec2_network: Ec2Network) -> None:
    provisioner = Ec2Provisioner(ec2_config(ec2_network))
    assert provisioner.poll_interruptions() == []


def test_a_request_tagged_spot_is_launched_on_spot_and_the_others_on_demand(
    ec2_network: Ec2Network,
) -> None:
    from provisioners.base import APP_TAG, LaunchRequest
    from provisioners.interruptions import MARKET_TAG

    maker = Ec2Provisioner(ec2_config(ec2_network))
    templates = maker.ensure_launch_templates(["m5.large"])
    # No deployment-wide spot: the request's market decides (the reconciler's rule 10).
    provisioner = Ec2Provisioner(ec2_config(ec2_network, launch_templates=templates))
    (spot,) = provisioner.launch(
        LaunchRequest("r-spot", "m5.large", 1, {APP_TAG: "recs", MARKET_TAG: "spot"})
    )
    (on_demand,) = provisioner.launch(LaunchRequest("r-od", "m5.large", 1, {APP_TAG: "recs"}))
    ec2 = boto3.client("ec2", region_name=REGION)
    lifecycle = {
        i["InstanceId"]: i.get("InstanceLifecycle")
        for r in ec2.describe_instances()["Reservations"]
        for i in r["Instances"]
    }
    assert lifecycle[spot.provider_id] == "spot"
    assert lifecycle[on_demand.provider_id] in (None, "on-demand")
    assert (spot.market, on_demand.market) == ("spot", "on-demand")


def ec2_without_templates(ec2_network: Ec2Network, clock: Any, board: PriceBoard) -> Any:
    """The EC2 provisioner on moto with no launch template (a spot fleet needs one), reading
    spot prices from ``board``."""
    session = boto3.Session()
    session.events.register("before-send.ec2.DescribeSpotPriceHistory", board)
    return Ec2Provisioner(
        ec2_config(ec2_network, spot_price_ttl_s=60.0), session, clock=clock.now_s
    )


def on_demand_cost(ec2: Any) -> float:
    """What EC2 bills now for the machines it runs, at the catalog's on-demand prices (none of
    them runs on spot in these tests)."""
    from estimator.catalog import default_catalog

    catalog = default_catalog()
    return sum(
        catalog[i["InstanceType"]].price_usd_per_hr
        for r in ec2.describe_instances()["Reservations"]
        for i in r["Instances"]
        if i["State"]["Name"] in ("pending", "running")
        and (i.get("InstanceLifecycle") or "on-demand") == "on-demand"
    )


def test_a_spot_launch_spot_cannot_supply_is_refused_then_launched_on_demand_within_the_budget(
    ec2_network: Ec2Network, tmp_path: Any
) -> None:
    """Without a launch template a request tagged spot cannot run on spot (a fleet needs one):
    the provider launches nothing (it had launched it on demand, billed at 0.0832 USD/hr where
    the budget was told 0.03), and the reconciler launches on demand from the next tick, priced
    so, as far as the budget pays: one of the two t3.large under 0.1."""
    board, clock, store, _ = reconciler_on_moto(ec2_network, tmp_path, {"t3.large": 0.03})
    from controlplane.loops.reconciler import Reconciler, catalog_pricing
    from estimator.catalog import default_catalog

    no_templates = ec2_without_templates(ec2_network, clock, board)
    reconciler = Reconciler(store, no_templates, clock, catalog_pricing(default_catalog()))
    budget = 0.1  # two t3.large on spot at 0.03; one at on demand (0.0832), not two
    ec2 = boto3.client("ec2", region_name=REGION)

    def billed() -> float:
        kept = store.list_instances("recs", states=["requested", "pending", "running"])
        return sum(r.price_usd_per_hr for r in kept)

    try:
        two = {"t3.large": 2}
        planned_recs(store, budget, ["t3.large"], 0.06, {"fleet": two, "spot_fleet": two})
        clock.advance(1.0)
        reconciler.run_once()
        assert on_demand_cost(ec2) == 0.0  # nothing run on demand at a spot price
        (refused, *_) = store.list_decisions("recs", kinds=["launch_failed"])
        assert refused.numbers["error"] == "SpotUnavailableError"
        assert "launch template" in refused.reason and "on demand at 0.0832" in refused.reason
        for _ in range(3):
            clock.advance(1.0)
            reconciler.run_once()
            assert billed() <= budget + 1e-9 and on_demand_cost(ec2) <= budget + 1e-9
        rows = [r for r in store.list_instances("recs") if r.provider_id]
        assert [(r.market, r.price_usd_per_hr) for r in rows] == [("on-demand", 0.0832)]
        assert len(store.list_instances("recs", states=["running"])) == 1
    finally:
        store.close()


def test_spot_launches_of_two_types_spot_cannot_supply_never_run_past_the_budget(
    ec2_network: Ec2Network, tmp_path: Any
) -> None:
    """Two types on spot in one tick, neither of which spot can supply: each was launched on
    demand (the second one too, after the first came back on demand): 0.168 USD/hr ran under a
    budget of 0.1 until the next tick's drain. Now neither runs on demand at a spot price, and
    the on-demand launches that follow fit the budget."""
    board, clock, store, _ = reconciler_on_moto(ec2_network, tmp_path, {"t3.large": 0.03})
    board.prices["c5.large"] = 0.034
    from controlplane.loops.reconciler import Reconciler, catalog_pricing
    from estimator.catalog import default_catalog

    no_templates = ec2_without_templates(ec2_network, clock, board)
    reconciler = Reconciler(store, no_templates, clock, catalog_pricing(default_catalog()))
    budget = 0.1  # both on spot: 0.064; on demand: 0.1682
    ec2 = boto3.client("ec2", region_name=REGION)
    try:
        fleet = {"t3.large": 1, "c5.large": 1}
        planned_recs(
            store, budget, sorted(fleet), 0.064, {"fleet": fleet, "spot_fleet": dict(fleet)}
        )
        for _ in range(4):
            clock.advance(1.0)
            reconciler.run_once()
            assert on_demand_cost(ec2) <= budget + 1e-9
        assert on_demand_cost(ec2) > 0  # one of them, on demand
    finally:
        store.close()


def test_a_spot_launch_run_on_demand_whose_answer_was_lost_is_adopted_on_demand(
    ec2_network: Ec2Network, tmp_path: Any
) -> None:
    """The control plane dies between the provider's answer and the row's move (the launch
    went through, on demand: a provider that runs what spot cannot supply on demand, as this
    one did before it refused such launches; here the request goes to EC2 untagged): the next
    one adopts the instance by its request id, on demand at the on-demand price, as EC2 bills
    it."""
    board, clock, store, _ = reconciler_on_moto(ec2_network, tmp_path, {"t3.large": 0.03})
    from controlplane.loops.reconciler import Reconciler, catalog_pricing
    from estimator.catalog import default_catalog

    session = boto3.Session()
    session.events.register("before-send.ec2.DescribeSpotPriceHistory", board)
    no_templates = Ec2Provisioner(
        ec2_config(ec2_network, spot_price_ttl_s=60.0), session, clock=clock.now_s
    )

    class DiesError(Exception):
        pass

    class DiesAfterLaunch:
        name = "ec2"

        def __getattr__(self, attribute: str) -> Any:
            return getattr(no_templates, attribute)

        def launch(self, request: Any) -> Any:
            tags = {k: v for k, v in request.tags.items() if k != MARKET_TAG}
            no_templates.launch(dataclasses.replace(request, tags=tags))
            raise DiesError(request.request_id)

    try:
        one = {"t3.large": 1}
        planned_recs(store, 0.1, ["t3.large"], 0.03, {"fleet": one, "spot_fleet": one})
        dying = Reconciler(store, DiesAfterLaunch(), clock, catalog_pricing(default_catalog()))
        with pytest.raises(DiesError):
            dying.run_once()
        (row,) = store.list_instances("recs")
        assert (row.state, row.market, row.provider_id) == ("requested", "spot", None)
        reconciler = Reconciler(store, no_templates, clock, catalog_pricing(default_catalog()))
        clock.advance(1.0)
        reconciler.run_once()
        (row,) = store.list_instances("recs")
        assert (row.market, row.price_usd_per_hr) == ("on-demand", 0.0832)
        assert row.state in ("pending", "running") and row.provider_id is not None
    finally:
        store.close()


def test_notices_on_the_queue_lead_to_replacements_and_drains_before_the_deadline(
    ec2_network: Ec2Network, tmp_path: Any
) -> None:
    """The whole EC2 path on moto: a reconciler (real store) over the EC2 provisioner reading the
    SQS queue; an interruption warning, a rebalance recommendation and a state change for three
    of its instances each lead to a replacement launched in the same tick and the instance
    drained and terminated before its deadline."""
    from controlplane.clock import FakeClock
    from controlplane.db import migrate
    from controlplane.db.store import Store
    from controlplane.loops.reconciler import (
        InterruptionHandled,
        Launch,
        Reconciler,
        catalog_pricing,
    )
    from estimator.catalog import default_catalog

    sqs = boto3.client("sqs", region_name=REGION)
    queue_url = sqs.create_queue(QueueName="heteroplane-interruptions")["QueueUrl"]
    database = f"sqlite:///{tmp_path / 'heteroplane.db'}"
    migrate.upgrade(database)
    clock = FakeClock(start_utc=datetime.now(UTC).replace(microsecond=0))
    store = Store.from_url(database, clock)
    provisioner = Ec2Provisioner(ec2_config(ec2_network, interruption_queue_url=queue_url))
    reconciler = Reconciler(
        store, provisioner, clock, catalog_pricing(default_catalog()), missing_grace_s=600.0
    )
    try:
        planned_recs(store, 1.0, ["t3.large"], 0.25, {"fleet": {"t3.large": 3}})

        def tick(seconds: float) -> list[object]:
            clock.advance(seconds)
            return list(reconciler.run_once().apps["recs"].actions)

        def provider_ids(state: str) -> list[str]:
            return [r.provider_id or "" for r in store.list_instances("recs", states=[state])]

        for _ in range(5):
            tick(1.0)
            if len(provider_ids("running")) == 3:
                break
        first, second, third = provider_ids("running")
        at = clock.utcnow()
        for body in (
            _event(
                "EC2 Spot Instance Interruption Warning",
                first,
                at,
                **{"instance-action": "terminate"},
            ),
            _event("EC2 Instance Rebalance Recommendation", second, at),
            _event("EC2 Instance State-change Notification", third, at, state="shutting-down"),
        ):
            sqs.send_message(QueueUrl=queue_url, MessageBody=body)

        actions = tick(1.0)

        handled = {a.provider_id for a in actions if isinstance(a, InterruptionHandled)}
        assert handled == {first, second, third}
        assert len([a for a in actions if isinstance(a, Launch)]) == 3  # replacements, at once
        assert third in provider_ids("terminating")  # no time left: at once
        deadline = at + timedelta(seconds=INTERRUPTION_NOTICE_S)
        # The other two serve until their replacements do, then drain and go.
        while set(provider_ids("running") + provider_ids("draining")) & {first, second}:
            tick(1.0)
        assert clock.utcnow() < deadline
        gone = {
            i["InstanceId"]: i["State"]["Name"]
            for r in boto3.client("ec2", region_name=REGION).describe_instances()["Reservations"]
            for i in r["Instances"]
        }
        assert {gone[p] for p in (first, second, third)} <= {"shutting-down", "terminated"}
        assert len(store.list_decisions("recs", kinds=["spot_interruption"])) == 3
    finally:
        store.close()


def test_the_cap_holds_when_spot_prices_read_from_ec2_rise_mid_run(
    ec2_network: Ec2Network, tmp_path: Any
) -> None:
    """A plan all on spot, launched by the reconciler over the EC2 provisioner (CreateFleet on
    moto) at the spot price DescribeSpotPriceHistory gives; the price rises to on demand: the
    next read (past the cache's TTL) costs the fleet past the budget, and the reconciler drains
    to fit it, with a spot_price decision, and launches nothing it cannot pay for."""
    board, clock, store, reconciler = reconciler_on_moto(ec2_network, tmp_path, {"t3.large": 0.03})
    budget = 0.1  # two t3.large on spot at 0.03; not two at on demand (0.0832 each)

    def paid_now() -> float:
        kept = store.list_instances("recs", states=["requested", "pending", "running"])
        return sum(
            (board.prices or {})["t3.large"] if r.market == "spot" else r.price_usd_per_hr
            for r in kept
        )

    try:
        serve_two_spot_t3_large(store, clock, reconciler, budget, ["t3.large"])
        rows = store.list_instances("recs", states=["running"])
        assert [(r.market, r.price_usd_per_hr) for r in rows] == [("spot", 0.03)] * 2
        ec2 = boto3.client("ec2", region_name=REGION)
        lifecycle = {
            i["InstanceId"]: i.get("InstanceLifecycle")
            for r in ec2.describe_instances()["Reservations"]
            for i in r["Instances"]
        }
        assert {lifecycle[r.provider_id or ""] for r in rows} == {"spot"}

        board.prices = {"t3.large": 0.0832}
        clock.advance(61.0)  # past the price cache's TTL
        reconciler.run_once()
        assert paid_now() <= budget + 1e-9
        (decision,) = store.list_decisions("recs", kinds=["spot_price"])
        assert "over it" in decision.reason and decision.numbers["price_usd_per_hr"] == 0.0832
        for _ in range(3):
            clock.advance(1.0)
            reconciler.run_once()
            assert paid_now() <= budget + 1e-9
        assert len(store.list_instances("recs", states=["running"])) == 1
        assert board.calls == 2  # once per TTL, not once per tick
    finally:
        store.close()


def test_a_spot_price_rise_read_from_ec2_moves_capacity_to_a_cheaper_spot_type(
    ec2_network: Ec2Network, tmp_path: Any
) -> None:
    """Two t3.large on spot; DescribeSpotPriceHistory then says t3.large rose to on demand,
    past the budget, while t3.xlarge (the plan's ranking's next type) is at 0.05: the reconciler
    terminates the two and launches two t3.xlarge on spot in the same tick, within the budget."""
    types = ["t3.large", "t3.xlarge"]
    board, clock, store, reconciler = reconciler_on_moto(
        ec2_network, tmp_path, {"t3.large": 0.03, "t3.xlarge": 0.05}
    )
    budget = 0.12  # two t3.large at 0.0832 (0.166) do not fit; two t3.xlarge at 0.05 do

    def paid_now() -> float:
        kept = store.list_instances("recs", states=["requested", "pending", "running"])
        prices = board.prices or {}
        return sum(
            prices[r.instance_type] if r.market == "spot" else r.price_usd_per_hr for r in kept
        )

    try:
        serve_two_spot_t3_large(store, clock, reconciler, budget, types)
        running = store.list_instances("recs", states=["running"])
        assert sorted((r.instance_type, r.market) for r in running) == [("t3.large", "spot")] * 2

        board.prices = {"t3.large": 0.0832, "t3.xlarge": 0.05}
        clock.advance(61.0)  # past the price cache's TTL
        reconciler.run_once()
        assert paid_now() <= budget + 1e-9
        kept = store.list_instances("recs", states=["requested", "pending", "running"])
        assert sorted((r.instance_type, r.market) for r in kept) == [("t3.xlarge", "spot")] * 2
        (moved,) = store.list_decisions("recs", kinds=["terminate"])
        assert moved.numbers["cause"] == "spot_price" and "t3.xlarge" in moved.reason
        for _ in range(3):
            clock.advance(1.0)
            reconciler.run_once()
            assert paid_now() <= budget + 1e-9
        running = store.list_instances("recs", states=["running"])
        assert sorted(r.instance_type for r in running) == ["t3.xlarge", "t3.xlarge"]
    finally:
        store.close()


# --- the move ahead of a breach (docs/spot.md): prices raised mid-run in steps ---------------

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
