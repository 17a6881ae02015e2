"""Cascades: validation records, quality, forwarding, the Pareto set, and the simulator hook."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from estimator.cascades import (
    Cascade,
    ValidationRecords,
    answering_stage,
    candidate_cascades,
    cascade_chains,
    cascade_stages,
    compute_ms_per_query,
    evaluate,
    forward_flags,
    load_validation,
    pareto_cascades,
    pareto_mask,
    split_sample_ids,
    validation_document,
    validation_from_document,
    with_sample_ids,
)
from estimator.errors import CascadeError, SimulationError
from estimator.profiles import LatencyProfile
from estimator.simulator import InstanceSpec, Routing, Stage, simulate
from estimator.traces import Trace, poisson_arrivals
from tests.unit import cascade_support as family


def toy() -> ValidationRecords:
    """Three samples, two models: hand-checkable."""
    return ValidationRecords(
        dataset="toy",
        seed=0,
        labels=np.array([0, 1, 2]),
        models=("a", "b"),
        predictions=np.array([[0, 0, 2], [0, 1, 1]]),
        correct=np.array([[True, False, True], [True, True, False]]),
        certainty=np.array([[0.9, 0.3, 0.5], [0.8, 0.7, 0.6]]),
        accuracy=np.array([2 / 3, 2 / 3]),
        params=np.array([10, 100]),
    )


# --- records ---------------------------------------------------------------------------------


def test_document_round_trips() -> None:
    records = family.records()
    again = validation_from_document(json.loads(json.dumps(validation_document(records))))
    assert again.models == records.models
    for name in ("labels", "predictions", "correct", "certainty", "accuracy", "params"):
        np.testing.assert_array_equal(getattr(again, name), getattr(records, name))


def _document() -> dict[str, object]:
    return validation_document(toy())


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d.update(format="other/v9"), "format"),
        (lambda d: d.pop("labels"), "labels"),
        (lambda d: d.update(labels=[0, 1.5, 2]), "labels[1]"),
        (lambda d: d.update(seed="x"), "seed"),
        (lambda d: d["models"][1].update(certainty=[0.8, 1.5, 0.6]), "models[1].certainty[1]"),
        (lambda d: d["models"][0].update(correct=[True, True, True]), "models[0].correct[1]"),
        (lambda d: d["models"][0].update(predictions=[0, 0]), "models[0].predictions"),
        (lambda d: d["models"][0].update(accuracy=0.1), "models[0].accuracy"),
        (lambda d: d["models"][0].pop("name"), "models[0].name"),
        (lambda d: d["models"][1].update(name="a"), "models"),
        (lambda d: d.update(models=[]), "models"),
    ],
)
def test_malformed_documents_name_the_field(edit, field: str) -> None:
    document = _document()
    edit(document)
    with pytest.raises(CascadeError) as caught:
        validation_from_document(document, source="v.json")
    assert caught.value.field == field
    assert str(caught.value).startswith(f"v.json: {field}")


def test_load_validation_reads_files_and_refuses_bad_ones(tmp_path: Path) -> None:
    path = tmp_path / "validation.json"
    path.write_text(json.dumps(validation_document(toy())))
    assert load_validation(path).models == ("a", "b")
    with pytest.raises(CascadeError, match="no such file"):
        load_validation(tmp_path / "missing.json")
    path.write_text("{not json")
    with pytest.raises(CascadeError, match="malformed JSON at line 1"):
        load_validation(path)


def test_unknown_model_is_named() -> None:
    with pytest.raises(CascadeError, match="no records for model 'c'"):
        evaluate(Cascade(("a", "c"), (0.5,)), toy())


# --- cascades and their quality --------------------------------------------------------------


def test_cascade_checks_its_thresholds() -> None:
    with pytest.raises(CascadeError, match="one threshold per model but the last"):
        Cascade(("a", "b"), ())
    with pytest.raises(CascadeError, match=r"thresholds\[0\]: must be in \[0, 1\]"):
        Cascade(("a", "b"), (1.5,))
    with pytest.raises(CascadeError, match="appears twice"):
        Cascade(("a", "a"), (0.5,))


def test_evaluate_by_hand() -> None:
    # a stops samples 0 (0.9 >= 0.6); samples 1 and 2 go on to b: b is right on 1, wrong on 2.
    quality = evaluate(Cascade(("a", "b"), (0.6,)), toy())
    assert quality.answered_share == pytest.approx((1 / 3, 2 / 3))
    assert quality.reach_share == pytest.approx((1.0, 2 / 3))
    assert quality.accuracy == pytest.approx(2 / 3)
    # Threshold 0.4: a stops 0 and 2 (both right), b answers 1 (right): all right.
    assert evaluate(Cascade(("a", "b"), (0.4,)), toy()).accuracy == 1.0
    assert answering_stage(Cascade(("a", "b"), (0.4,)), toy()).tolist() == [0, 1, 0]


@settings(max_examples=60, deadline=None)
@given(
    thresholds=st.lists(st.floats(0.0, 1.0), min_size=2, max_size=2),
    seed=st.integers(0, 1000),
)
def test_evaluate_matches_a_per_sample_loop(thresholds: list[float], seed: int) -> None:
    records = family.records(seed, n_samples=60)
    cascade = Cascade(records.models, tuple(thresholds))
    quality = evaluate(cascade, records)
    right, reached = 0, np.zeros(3)
    for j in range(records.n_samples):
        for i in range(3):
            reached[i] += 1
            if i == 2 or records.certainty[i, j] >= thresholds[i]:
                right += int(records.correct[i, j])
                break
    assert quality.accuracy == pytest.approx(right / records.n_samples)
    assert quality.reach_share == pytest.approx(tuple(reached / records.n_samples))
    assert sum(quality.answered_share) == pytest.approx(1.0)


def test_forward_flags_follow_the_answering_stage() -> None:
    records = family.records()
    cascade = Cascade(records.models, (0.7, 0.5))
    ids = np.random.default_rng(3).integers(0, records.n_samples, size=500)
    flags = forward_flags(cascade, records, ids)
    stage = answering_stage(cascade, records, ids)
    assert len(flags) == 3 and not flags[2].any()
    np.testing.assert_array_equal(flags[0], stage > 0)
    np.testing.assert_array_equal(flags[1], stage > 1)
    with pytest.raises(CascadeError, match="sample 400 is not in the validation records"):
        forward_flags(cascade, records, np.array([0, 400]))


def test_compute_per_query_weights_compute_by_reach() -> None:
    records = family.records()
    cascade = Cascade(records.models, (0.7, 0.5))
    reach = evaluate(cascade, records).reach_share
    compute = {"tiny": 1.0, "small": 3.0, "large": 20.0}
    expected = reach[0] * 1.0 + reach[1] * 3.0 + reach[2] * 20.0
    assert compute_ms_per_query(cascade, records, compute) == pytest.approx(expected)
    with pytest.raises(CascadeError, match="no compute given for model 'large'"):
        compute_ms_per_query(cascade, records, {"tiny": 1.0, "small": 3.0})


# --- the Pareto set --------------------------------------------------------------------------


def test_chains_keep_the_order_and_count() -> None:
    chains = cascade_chains(["a", "b", "c", "d"])
    assert len(chains) == 2**4 - 1
    assert all(list(chain) == sorted(chain) for chain in chains)
    grid = (0.2, 0.8)
    assert len(list(candidate_cascades(chains, grid))) == sum(2 ** (len(c) - 1) for c in chains)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=12))
def test_pareto_mask_against_brute_force(points: list[tuple[int, int]]) -> None:
    accuracy = np.array([float(a) for a, _ in points])
    cost = np.array([float(c) for _, c in points])
    keep = pareto_mask(accuracy, cost)
    for p in range(len(points)):
        dominated = any(
            accuracy[q] >= accuracy[p]
            and cost[q] <= cost[p]
            and (accuracy[q] > accuracy[p] or cost[q] < cost[p])
            for q in range(len(points))
        )
        duplicate_before = any(points[q] == points[p] for q in range(p))
        assert keep[p] == (not dominated and not duplicate_before)


def test_pareto_cascades_dominate_every_other_candidate() -> None:
    records = family.records()
    compute = {"tiny": 1.0, "small": 4.0, "large": 20.0}
    grid = (0.3, 0.6, 0.9)
    front = pareto_cascades(records, compute, grid=grid)
    costs = [p.compute_ms_per_query for p in front]
    assert costs == sorted(costs)
    assert [p.quality.accuracy for p in front] == sorted(p.quality.accuracy for p in front)
    for cascade in candidate_cascades(cascade_chains(records.models), grid):
        accuracy = evaluate(cascade, records).accuracy
        cost = compute_ms_per_query(cascade, records, compute)
        assert any(
            p.quality.accuracy >= accuracy - 1e-12 and p.compute_ms_per_query <= cost + 1e-12
            for p in front
        )


# --- cascades in the simulator ---------------------------------------------------------------


def _stages(cascade: Cascade, records: ValidationRecords, trace: Trace, **kwargs) -> list[Stage]:
    profiles = family.profiles()
    instances = {m: (InstanceSpec(family.TYPE),) * 2 for m in records.models}
    return cascade_stages(cascade, records, trace.sample_id, instances, profiles, **kwargs)


def test_simulated_reach_equals_the_records_reach() -> None:
    records = family.records()
    cascade = Cascade(records.models, (0.7, 0.5))
    n = 5 * records.n_samples  # every sample exactly five times
    arrival = poisson_arrivals(40.0, n / 40.0 + 60, np.random.default_rng(1))[:n]
    trace = Trace(arrival, np.ones(n, dtype=np.int64), np.arange(n) % records.n_samples)
    stages = _stages(cascade, records, trace, max_batch_queries=4)
    result = simulate(trace, stages, np.random.default_rng(2), prices_usd_per_hr=family.PRICES)
    reach = evaluate(cascade, records).reach_share
    for i in range(3):
        assert np.count_nonzero(result.stages_visited > i) / n == pytest.approx(reach[i])
    np.testing.assert_array_equal(
        result.answered_stage, answering_stage(cascade, records, trace.sample_id)
    )


def test_response_spans_every_visited_stage() -> None:
    records = family.records()
    cascade = Cascade(records.models, (0.8, 0.6))
    arrival = poisson_arrivals(30.0, 30.0, np.random.default_rng(4))
    trace = with_sample_ids(
        Trace(arrival, np.ones(arrival.size, dtype=np.int64)), records, np.random.default_rng(5)
    )
    stages = _stages(cascade, records, trace)
    result = simulate(
        trace, stages, np.random.default_rng(6), prices_usd_per_hr=family.PRICES, service="mean"
    )
    service = np.array(
        [family.profiles()[m][family.TYPE].mean_latency_ms(1) for m in records.models]
    )
    needed = np.cumsum(service)[result.stages_visited - 1]
    assert np.all(result.response_ms >= needed - 1e-9)
    assert np.any(result.stages_visited == 3)  # some queries were forwarded twice


def test_a_trace_without_sample_ids_is_refused() -> None:
    records = family.records()
    trace = Trace(np.array([0.0, 1.0]), np.ones(2, dtype=np.int64))
    with pytest.raises(CascadeError, match="the trace carries no sample ids"):
        _stages(Cascade(records.models, (0.5, 0.5)), records, trace)


# --- the simulator's routing hook ------------------------------------------------------------


def _chain_profiles() -> tuple[dict[str, LatencyProfile], ...]:
    profiles = family.profiles()
    return tuple(profiles[m] for m in family.MODELS)


def test_one_mode_routing_equals_forward_flags() -> None:
    records = family.records()
    cascade = Cascade(records.models, (0.7, 0.5))
    arrival = poisson_arrivals(60.0, 20.0, np.random.default_rng(7))
    trace = with_sample_ids(
        Trace(arrival, np.ones(arrival.size, dtype=np.int64)), records, np.random.default_rng(8)
    )
    flagged = _stages(cascade, records, trace, max_batch_queries=2)
    plain = [Stage(s.model, s.instances, s.profiles, max_batch_queries=2) for s in flagged]
    stop = answering_stage(cascade, records, trace.sample_id)
    nxt = np.full((1, 3, arrival.size), -1)
    nxt[0, 0] = np.where(stop > 0, 1, -1)
    nxt[0, 1] = np.where(stop > 1, 2, -1)
    routing = Routing(np.zeros((1, arrival.size)), nxt, np.full((1, 3), 2))
    a = simulate(trace, flagged, np.random.default_rng(9), prices_usd_per_hr=family.PRICES)
    b = simulate(
        trace, plain, np.random.default_rng(9), prices_usd_per_hr=family.PRICES, routing=routing
    )
    np.testing.assert_array_equal(a.finish_s, b.finish_s)
    np.testing.assert_array_equal(a.start_s, b.start_s)
    np.testing.assert_array_equal(a.stages_visited, b.stages_visited)


class _SwitchAt:
    """Mode 0 until ``at_s``, then mode 1; records what it saw."""

    def __init__(self, at_s: float) -> None:
        self.at_s = at_s
        self.seen: list[tuple[float, tuple[int, ...]]] = []

    @property
    def period_s(self) -> float:
        return 0.5

    def initial_mode(self) -> int:
        return 0

    def tick(self, now_s: float, queue_lengths: tuple[int, ...]) -> int:
        self.seen.append((now_s, queue_lengths))
        return 1 if now_s >= self.at_s else 0


def test_a_controller_switches_routes_for_later_arrivals() -> None:
    profiles = _chain_profiles()
    n = 400
    arrival = np.linspace(0.0, 10.0, n)
    trace = Trace(arrival, np.ones(n, dtype=np.int64))
    stages = [
        Stage(m, (InstanceSpec(family.TYPE),), p)
        for m, p in zip(family.MODELS, profiles, strict=True)
    ]
    # Mode 0 answers at stage 0; mode 1 enters at stage 0 and goes on to stage 2 (skipping 1).
    nxt = np.full((2, 3, n), -1)
    nxt[1, 0] = 2
    routing = Routing(np.zeros((2, n)), nxt, np.array([[1, 1, 1], [4, 1, 1]]))
    controller = _SwitchAt(5.0)
    result = simulate(
        trace,
        stages,
        np.random.default_rng(0),
        prices_usd_per_hr=family.PRICES,
        routing=routing,
        controller=controller,
    )
    assert result.mode is not None and result.answered_stage is not None
    late = arrival > 5.0
    assert np.all(result.mode[late] == 1) and np.all(result.mode[arrival < 5.0] == 0)
    assert np.all(result.answered_stage[late] == 2) and np.all(result.stages_visited[late] == 2)
    assert np.all(result.answered_stage[~late] == 0)
    assert [t for t, _ in controller.seen][:3] == [0.5, 1.0, 1.5]
    assert all(len(lengths) == 3 for _, lengths in controller.seen)
    assert not np.isnan(result.finish_s).any()


def test_routing_is_checked() -> None:
    with pytest.raises(SimulationError, match="a next stage must be a later stage"):
        Routing(np.zeros((1, 2)), np.zeros((1, 2, 2)), np.ones((1, 2)))
    with pytest.raises(SimulationError, match="routing shapes disagree"):
        Routing(np.zeros((1, 3)), np.full((1, 2, 2), -1), np.ones((1, 2)))
    profiles = _chain_profiles()
    trace = Trace(np.array([0.0, 1.0]), np.ones(2, dtype=np.int64))
    stage = Stage("tiny", (InstanceSpec(family.TYPE),), profiles[0], forward=np.array([1, 0]))
    routing = Routing(np.zeros((1, 2)), np.full((1, 1, 2), -1), np.ones((1, 1)))
    with pytest.raises(SimulationError, match="forward flags or a routing, not both"):
        simulate(
            trace,
            [stage],
            np.random.default_rng(0),
            prices_usd_per_hr=family.PRICES,
            routing=routing,
        )
    plain = Stage("tiny", (InstanceSpec(family.TYPE),), profiles[0])
    with pytest.raises(SimulationError, match="a mode controller needs a routing"):
        simulate(
            trace,
            [plain],
            np.random.default_rng(0),
            prices_usd_per_hr=family.PRICES,
            controller=_SwitchAt(1.0),
        )


# --- the held-out protocol -------------------------------------------------------------------


def test_the_split_is_deterministic_disjoint_and_covers_every_sample() -> None:
    records = family.records(n_samples=401)
    choose_ids, score_ids = split_sample_ids(records, 0.5, seed=7)
    again = split_sample_ids(records, 0.5, seed=7)
    assert np.array_equal(choose_ids, again[0]) and np.array_equal(score_ids, again[1])
    assert not set(choose_ids.tolist()) & set(score_ids.tolist())
    assert sorted([*choose_ids.tolist(), *score_ids.tolist()]) == list(range(401))
    assert choose_ids.size == 201  # round(401 / 2), half up
    other = split_sample_ids(records, 0.5, seed=8)
    assert not np.array_equal(choose_ids, other[0])  # another seed, another split


def test_the_split_is_stratified_by_label() -> None:
    records = family.records(n_samples=600)
    for share in (0.5, 0.3):
        choose_ids, _ = split_sample_ids(records, share, seed=0)
        for label in np.unique(records.labels):
            in_class = int(np.sum(records.labels == label))
            chosen = int(np.sum(records.labels[choose_ids] == label))
            assert abs(chosen - share * in_class) <= 1


def test_split_records_are_the_subsets_with_their_own_accuracy() -> None:
    records = family.records(n_samples=300)
    choose, score = records.split(0.5, 3)
    choose_ids, score_ids = split_sample_ids(records, 0.5, 3)
    assert choose.n_samples + score.n_samples == records.n_samples
    assert np.array_equal(choose.labels, records.labels[choose_ids])
    assert np.array_equal(score.certainty, records.certainty[:, score_ids])
    for model in records.models:
        row = records.model_index(model)
        assert score.model_accuracy(model) == pytest.approx(records.correct[row, score_ids].mean())
    # Scoring a cascade on a split is scoring it on those samples of the whole.
    cascade = Cascade(records.models[:2], (0.6,))
    whole = answering_stage(cascade, records)
    assert np.array_equal(answering_stage(cascade, choose), whole[choose_ids])


@pytest.mark.parametrize("share", [0.0, 1.0, -0.1, float("nan")])
def test_the_split_refuses_a_share_outside_the_open_interval(share: float) -> None:
    with pytest.raises(CascadeError, match="share"):
        family.records().split(share, 0)


def test_a_split_that_would_leave_one_side_empty_is_refused() -> None:
    one = family.records(n_samples=1)
    with pytest.raises(CascadeError, match="empty"):
        one.split(0.5, 0)


def overfit_records() -> ValidationRecords:
    """Two models, ``tiny`` (cheap) and ``large``, where ``tiny``'s certainty means something
    only on the choose split of seed 0: there it is certain (0.95) exactly when right; on the
    score split it is as certain on half the samples it gets wrong."""
    n = 40
    labels = np.arange(n) % 2
    shape_only = ValidationRecords(
        dataset="overfit",
        seed=0,
        labels=labels,
        models=("tiny",),
        predictions=labels[None, :],
        correct=np.ones((1, n), dtype=bool),
        certainty=np.full((1, n), 0.5),
        accuracy=np.array([1.0]),
        params=np.array([1]),
    )
    choose_ids, score_ids = split_sample_ids(shape_only, 0.5, 0)  # depends on the labels only
    right = np.zeros(n, dtype=bool)
    certainty = np.full(n, 0.2)
    right[choose_ids[::2]] = True  # half the choose split: right and certain
    certainty[choose_ids[::2]] = 0.95
    right[score_ids[::2]] = True  # half the score split: right and certain...
    certainty[score_ids] = 0.95  # ...but certain on the other half too, where it is wrong
    predictions = np.where(right, labels, 1 - labels)
    correct = np.array([right, np.ones(n, dtype=bool)])
    return ValidationRecords(
        dataset="overfit",
        seed=0,
        labels=labels,
        models=("tiny", "large"),
        predictions=np.array([predictions, labels]),
        correct=correct,
        certainty=np.array([certainty, np.full(n, 0.5)]),
        accuracy=correct.mean(axis=1),
        params=np.array([1, 100]),
    )


def test_a_cascade_chosen_on_one_split_is_scored_on_the_other() -> None:
    from controlplane.policies.cascade_choice import best_point, choose_held_out

    records = overfit_records()
    compute_ms = {"tiny": 1.0, "large": 3.0}
    choice = choose_held_out(records, compute_ms, share=0.5, seed=0)
    assert choice.best is not None
    # On the choose split tiny's certainty separates right from wrong: the cheapest cascade as
    # accurate as large alone stops the certain half at tiny.
    assert choice.best.cascade == Cascade(("tiny", "large"), (0.3,))
    assert choice.best.quality.accuracy == 1.0  # in-sample
    # On the score split the same thresholds stop wrong answers at tiny.
    assert choice.held_out_accuracy(choice.best.cascade) == 0.5
    assert evaluate(choice.best.cascade, records).accuracy == 0.75  # the old, pooled figure
    assert choice.model_accuracy("large") == (1.0, 1.0)
    # The choice is the rule applied to the choose split alone.
    front = pareto_cascades(choice.choose, compute_ms)
    assert best_point(front, 1.0) == choice.best
