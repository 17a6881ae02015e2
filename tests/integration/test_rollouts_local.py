"""Rollouts on the real service (issue 34's acceptance): ``heteroplane serve``'s whole service
behind a real uvicorn server, the local provisioner's real worker processes loading ONNX
artifacts from the registry, the CLI (``heteroplane rollout``), and a client sending queries
all along with its own request ids; every one of them must be answered (200).

The model is the bag-of-tokens ONNX classifier of ``benchmarks/bad_queries.py`` (version 1),
served by one ``emu.cpu.large`` worker. Then, one after the other:

- **a good version** (the same weights saved again, version 2) goes through 50 % and 100 %
  and is promoted: the app's spec names version 2, the old worker is handed over (ended, and
  a new one started by the reconciler with version 2), the rollout's worker ends;
- **a wrong one** (version 3: the output layer's weights and bias negated, so its argmax is the
  old one's argmin) rolls back on agreement in shadow mode, while every client still got the
  serving version's answer;
- **a slow one** (version 4: version 2 padded with a chain of 1024 x 1024 MatMuls whose sum, 0,
  is added to the scores: the same answers, tens of times the compute) rolls back on
  latency with the default thresholds: the app's SLO is lowered to 10 ms first (the tiny model
  answers in a few ms; the padded one took 108 ms a call on the 2-core machine, one
  onnxruntime thread, and takes tens of ms even on a much faster one), and the new version,
  timed alone on its worker before any traffic moves, is over it:
  no client query reached it, so its SLO misses are none, within the canary share.

Everything is polled against deadlines; nothing is timed.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from benchmarks.bad_queries import MODEL, TOKENS, VOCABULARY, export_model, profile_file
from controlplane.cli import main
from controlplane.service.build import Service, build_service
from controlplane.settings import Settings
from provisioners.local import LocalProvisioner
from tests.integration.conftest import ApiServer, launch_fleet, stop_every_worker
from tests.integration.test_byom import _cli, service

__all__ = ["service"]  # the fixture, imported for this module's tests

pytest.importorskip("torch")
pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

APP = "tokens"
TYPE = "emu.cpu.large"
DEADLINE_S = 240.0
POLL_S = 0.2
# The slow version's padding: 4 MatMuls of 1024 x 1024 (about 8.6 GFLOP a call). Before the
# roll-back it is timed alone (the profile run, then warm-up and 20 calls at each batch size):
# with 20 layers (0.5 s a call here) the test took 89 s of the machine's CPU, with 4 35 s.
PAD_LAYERS = 4
PAD_SIZE = 1024
# The SLO the slow version is judged against (the app's, lowered for it).
SLOW_SLO_MS = 10


def _padded(model: Path, layers: int = PAD_LAYERS, size: int = PAD_SIZE) -> Path:
    """The model with extra compute that changes no answer: a chain of ``layers`` MatMuls of a
    ``size`` x ``size`` matrix (scaled by the sum of the tokens, so that nothing folds it at
    load) by a zero matrix, whose sum (0) is added to the scores."""
    proto = onnx.load(str(model))
    graph = proto.graph
    out = graph.output[0].name
    for node in graph.node:
        node.output[:] = [f"{out}_unpadded" if o == out else o for o in node.output]
    helper, numpy_helper = onnx.helper, onnx.numpy_helper
    graph.initializer.extend(
        [
            numpy_helper.from_array(np.zeros((size, size), np.float32), "pad_zero"),
            numpy_helper.from_array(np.ones((size, size), np.float32), "pad_ones"),
        ]
    )
    nodes = [
        helper.make_node("Cast", ["tokens"], ["pad_tokens"], to=onnx.TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["pad_tokens"], ["pad_scale"], keepdims=0),
        helper.make_node("Mul", ["pad_ones", "pad_scale"], ["pad_0"]),
    ]
    nodes += [
        helper.make_node("MatMul", [f"pad_{k}", "pad_zero"], [f"pad_{k + 1}"])
        for k in range(layers)
    ]
    nodes += [
        helper.make_node("ReduceSum", [f"pad_{layers}"], ["pad_sum"], keepdims=0),
        helper.make_node("Add", [f"{out}_unpadded", "pad_sum"], [out]),
    ]
    graph.node.extend(nodes)
    onnx.checker.check_model(proto)
    path = model.with_name("tokens-slow.onnx")
    onnx.save(proto, str(path))
    return path


def _same_weights(model: Path) -> Path:
    """The model saved again with a doc string: the same answers from other bytes (a push of
    the newest version's very file answers that version and makes none)."""
    proto = onnx.load(str(model))
    proto.doc_string = "the same weights, exported again"
    path = model.with_name("tokens-again.onnx")
    onnx.save(proto, str(path))
    return path


def _wrong(model: Path) -> Path:
    """The model with its output layer negated (every answer's class changes)."""
    proto = onnx.load(str(model))
    graph_inputs = {i.name for i in proto.graph.input}
    changed = 0
    for tensor in proto.graph.initializer:
        array = onnx.numpy_helper.to_array(tensor)
        if tensor.name not in graph_inputs and array.shape in ((3, 8), (8, 3), (3,)):
            tensor.CopyFrom(onnx.numpy_helper.from_array(-array, tensor.name))
            changed += 1
    assert changed == 2, [t.name for t in proto.graph.initializer]
    path = model.with_name("tokens-wrong.onnx")
    onnx.save(proto, str(path))
    return path


PACE_S = 0.01  # the client's queries: about 100 a second at most


class Client(threading.Thread):
    """Queries one after another (request ids ``c-0``, ``c-1``, ...), at most one every
    ``PACE_S``, until stopped; counts the answers' statuses. (Paced: flat out, it took the CPU
    the rest of the suite runs on, and a step needs only ``--min-queries`` of them.)"""

    def __init__(self, url: str, token: str) -> None:
        super().__init__(daemon=True)
        self.url, self.token = url, token
        self.statuses: Counter[int] = Counter()
        self.stop = threading.Event()

    def run(self) -> None:
        rng = np.random.default_rng(0)
        headers = {"Authorization": f"Bearer {self.token}"}
        with httpx.Client(base_url=self.url, timeout=60.0, trust_env=False) as client:
            k = 0
            while not self.stop.is_set():
                tokens = rng.integers(0, VOCABULARY, size=TOKENS).tolist()
                answer = client.post(
                    f"/v1/apps/{APP}/infer",
                    json={"inputs": [tokens]},
                    headers={**headers, "X-Request-Id": f"c-{k}"},
                )
                self.statuses[answer.status_code] += 1
                k += 1
                self.stop.wait(PACE_S)


def _serve(
    service: Service,
    models: list[str],
    profiles: Path,
    cascade: dict[str, Any] | None = None,
) -> None:
    """The app of ``models`` (version 1 of each; a cascade of them in that order with
    ``cascade``'s fields), a plan of one worker per model (batch cap 4, fcfs), applied, and its
    workers running."""
    spec: dict[str, Any] = {
        "name": APP,
        "models": [{"name": n, "artifact": f"{n}@1", "profiles": str(profiles)} for n in models],
        "slo": {"latency_ms": 2000},
        "budget_usd_per_hr": 1.0,
        "instance_types": [TYPE],
    }
    if cascade is not None:
        spec |= {"cascade": list(models), **cascade}
    service.store.create_app(spec, who="test")
    stages = [{"name": n, "fleet": {TYPE: 1}, "batch_size": 4, "policy": "fcfs"} for n in models]
    plan = service.store.create_plan(
        APP, {"feasible": True, "cost_usd_per_hr": 0.1 * len(models), "stages": stages}
    )
    service.store.apply_plan(APP, plan.id)
    launch_fleet(service, APP, len(models))


def plan_one_worker(api: httpx.Client, profiles: Path, budget_usd_per_hr: float) -> None:
    """Through the API ``api`` speaks to: the app of ``MODEL``'s version 1 on at most one
    worker of ``TYPE``, planned at 5 q/s and applied (the service launches the worker)."""
    spec = {
        "name": APP,
        "models": [{"name": MODEL, "artifact": f"{MODEL}@1", "profiles": str(profiles)}],
        "slo": {"latency_ms": 2000},
        "budget_usd_per_hr": budget_usd_per_hr,
        "instance_types": [TYPE],
        "max_counts": {TYPE: 1},
    }
    assert api.post("/v1/apps", json=spec).status_code == 201
    plan = api.post(f"/v1/apps/{APP}/plans", json={"rate_qps": 5.0})
    assert plan.status_code == 201 and plan.json()["feasible"], plan.text
    assert api.post(f"/v1/apps/{APP}/plans/{plan.json()['id']}/apply").status_code == 200


def _wait_rollout(capsys: pytest.CaptureFixture[str], done: Any) -> dict[str, Any]:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        status = _cli(capsys, "rollout", "status", "--app", APP)
        if done(status):
            return dict(status)
        if time.monotonic() > deadline:
            pytest.fail(f"the rollout did not get there within {DEADLINE_S:g} s: {status}")
        time.sleep(POLL_S)


@pytest.mark.slow  # three worker processes start one after the other (seconds each)
def test_promote_roll_back_on_latency_and_on_agreement_in_shadow(
    service: Service,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = export_model(tmp_path)
    admin = service.store.create_token("admin", name="operator")
    infer = service.store.create_token("infer", name="client")
    with ApiServer(service) as url:
        monkeypatch.setenv("HETEROPLANE_URL", url)
        monkeypatch.setenv("HETEROPLANE_TOKEN", admin)
        for path in (model, _same_weights(model), _wrong(model), _padded(model)):
            _cli(capsys, "model", "push", MODEL, str(path))
        store = service.store
        # Batch sizes 1 and 4 only: the start's profile run times the padded version at each.
        # In the data directory: the spec is sent again (PUT) to lower the SLO.
        _serve(service, [MODEL], profile_file(service.settings.data_dir, (1, 4)))
        # Bad input through the CLI: one line, exit 2 (the server's 4xx message).
        for argv, message in (
            (["status", "--app", APP], f"app {APP!r} has no rollout"),
            (["start", "--app", APP, "--model", f"{MODEL}@1"], f"already serves {MODEL}@1"),
            (["start", "--app", APP, "--model", f"{MODEL}@9"], f"no model '{MODEL}@9'"),
            (["abort", "--app", APP], f"app {APP!r} has no rollout"),
        ):
            capsys.readouterr()
            with pytest.raises(SystemExit) as exited:
                main(["rollout", *argv])
            assert exited.value.code == 2, argv
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and message in err[0], (argv, err)
        client = Client(url, infer)
        client.start()
        try:
            started = _cli(
                capsys,
                "rollout",
                "start",
                "--app",
                APP,
                "--model",
                f"{MODEL}@2",
                "--steps",
                "50,100",
                "--interval-s",
                "1",
                "--min-queries",
                "5",
            )
            # The start returns at once: the rollout loop profiles the new version first.
            assert (started["state"], started["from_version"], started["to_version"]) == (
                "pending",
                1,
                2,
            )
            assert started["phase"] == "profiling" and started["profiled"] is None, started
            promoted = _wait_rollout(capsys, lambda s: s["state"] == "promoted")
            # Profiled on the app's types before traffic (a profile run's worker); the plan,
            # written by hand, has no rate to plan on again: the extra fleet is sized from its
            # stage (one instance at 50 % and at 100 %).
            profiled = promoted["profiled"]
            assert profiled["instance_types"] == [TYPE] and profiled["profiles"], profiled
            assert "no planned rate" in profiled["not_planned"], profiled
            assert promoted["extra_fleet"] == {TYPE: 1}, promoted
            # The last step's figures: the new version answered queries at 100 %, none failed.
            last = promoted["figures"]["versions"][f"{MODEL}@2"]
            assert last["queries"] >= 5 and last["errors"] == 0, promoted
            assert store.get_app(APP).spec["models"][0]["artifact"] == f"{MODEL}@2"

            def decisions() -> list[str]:
                return [d.reason for d in store.list_decisions(APP, kinds=["rollout"])]

            deadline = time.monotonic() + DEADLINE_S
            while not any("handover done" in r for r in decisions()):
                assert time.monotonic() < deadline, decisions()
                time.sleep(POLL_S)
            # Once the rollout's worker has ended, the app is planned again, once: its plan,
            # written by hand, has no rate to plan on again, so it stays and the decision says so.
            stays = "stays (the plan has no planned rate to plan for again): plan again"
            while not any(stays in r for r in decisions()):
                assert time.monotonic() < deadline, decisions()
                time.sleep(POLL_S)
            assert sum(stays in r for r in decisions()) == 1, decisions()

            _cli(
                capsys,
                "rollout",
                "start",
                "--app",
                APP,
                "--model",
                f"{MODEL}@3",
                "--shadow",
                "--interval-s",
                "1",
                "--min-queries",
                "5",
            )
            wrong = _wait_rollout(capsys, lambda s: s["state"] == "rolled_back")
            assert "agreement with the old version" in wrong["reason"], wrong
            assert store.get_app(APP).spec["models"][0]["artifact"] == f"{MODEL}@2"

            # The slow one, judged with the default thresholds against the app's SLO, lowered.
            spec = dict(store.get_app(APP).spec)
            spec["slo"] = {**spec["slo"], "latency_ms": SLOW_SLO_MS}
            headers = {"Authorization": f"Bearer {admin}"}
            changed = httpx.put(f"{url}/v1/apps/{APP}", json=spec, headers=headers, timeout=60)
            assert changed.status_code == 200, changed.text
            _cli(
                capsys, "rollout", "start", "--app", APP, "--model", f"{MODEL}@4",
                "--steps", "50,100", "--interval-s", "1", "--min-queries", "5",
            )  # fmt: skip
            slow = _wait_rollout(capsys, lambda s: s["state"] == "rolled_back")
            assert slow["thresholds"]["max_p99_ms"] is None, slow  # the default: the SLO
            assert slow["reason"].startswith("rolled back before traffic: alone, the new version's")
            assert f"over the limit {SLOW_SLO_MS} ms" in slow["reason"], slow["reason"]
            assert slow["figures"]["pre_traffic"]["measured"] is True
            # No client query reached it: its SLO misses are none, within the canary share.
            reached = slow["figures"].get("versions", {}).get(f"{MODEL}@4", {})
            assert reached.get("queries", 0) == 0, slow["figures"]
            assert store.get_app(APP).spec["models"][0]["artifact"] == f"{MODEL}@2"
        finally:
            client.stop.set()
            client.join(timeout=60.0)
    assert client.statuses[200] > 0 and set(client.statuses) == {200}, client.statuses
    print(json.dumps({"answered": client.statuses[200]}))


@pytest.mark.slow  # three worker processes (two for the cascade, one for the rollout)
def test_a_cascade_member_rollout_re_derives_the_thresholds(
    service: Service,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cascade of the ONNX model under two names (``tok-a`` first, ``tok-b`` last), both
    version 1; ``tok-a``'s version 2 is the wrong (negated) model. ``rollout start
    --validation-data`` runs the members here on labelled data (the labels are version 1's own
    answers), the service re-derives the threshold and states the held-out accuracy before any
    traffic moves; promoted, the spec carries the new threshold and the records."""
    import onnxruntime

    model = export_model(tmp_path)
    wrong = _wrong(model)
    admin = service.store.create_token("admin", name="operator")
    infer = service.store.create_token("infer", name="client")
    rng = np.random.default_rng(5)
    inputs = rng.integers(0, VOCABULARY, size=(400, TOKENS)).astype(np.int64)
    session = onnxruntime.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    (scores,) = session.run(None, {"tokens": inputs})
    data = tmp_path / "validation.npz"
    np.savez(data, inputs=inputs, labels=np.asarray(scores).argmax(axis=1))
    profiles = tmp_path / "cascade-profiles.json"
    profiles.write_text(
        json.dumps(
            {
                "profiles": [
                    {
                        "model": name,
                        "instance_type": TYPE,
                        "batch_sizes": [1, 2, 4, 8],
                        "latency_ms": [ms + 0.1 * b for b in (1, 2, 4, 8)],
                    }
                    for name, ms in (("tok-a", 1.0), ("tok-b", 4.0))
                ]
            }
        )
    )
    with ApiServer(service) as url:
        monkeypatch.setenv("HETEROPLANE_URL", url)
        monkeypatch.setenv("HETEROPLANE_TOKEN", admin)
        for name, path in (("tok-a", model), ("tok-b", model), ("tok-a", wrong)):
            _cli(capsys, "model", "push", name, str(path))
        store = service.store
        _serve(service, ["tok-a", "tok-b"], profiles, cascade={"thresholds": [0.5]})
        client = Client(url, infer)
        client.start()
        try:
            started = _cli(
                capsys, "rollout", "start", "--app", APP, "--model", "tok-a@2",
                "--steps", "100", "--interval-s", "1", "--min-queries", "5",
                "--validation-data", str(data),
            )  # fmt: skip
            cascade = started["cascade"]
            # The new tok-a is always wrong: only thresholds that send every query on to tok-b
            # keep the cascade within half a point of tok-b alone.
            assert cascade["thresholds_before"] == [0.5]
            assert cascade["thresholds"] != [0.5] and cascade["meets_floor"]
            assert cascade["held_out_accuracy"] >= 0.99 and cascade["held_out_samples"] == 200
            assert started["extra_fleet"] == {TYPE: 2}  # the whole cascade, once more
            done = _wait_rollout(capsys, lambda s: s["state"] in ("promoted", "rolled_back"))
            assert done["state"] == "promoted", done
            spec = store.get_app(APP).spec
            assert spec["thresholds"] == cascade["thresholds"]
            assert spec["validation"] == cascade["validation"]
        finally:
            client.stop.set()
            client.join(timeout=60.0)
    assert client.statuses[200] > 0 and set(client.statuses) == {200}, client.statuses


@pytest.mark.slow  # two services one after the other, three worker processes
def test_a_restart_mid_rollout_resumes_where_it_was(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The service is stopped while a rollout is at its first step and a new one started on the
    same data directory (the local workers, the fleet's and the rollout's, outlive it as they
    outlive any restart): the new service's loop picks the rollout up at the step the database
    says, with the same workers (none launched again), and promotes it; every query sent to
    either service is answered."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    model = export_model(tmp_path)
    first = build_service(Settings(data_dir=data_dir, provisioner="local", reconcile_s=0.5))
    provisioner = first.provisioner
    statuses: Counter[int] = Counter()
    try:
        admin = first.store.create_token("admin", name="operator")
        infer = first.store.create_token("infer", name="client")
        with ApiServer(first) as url:
            monkeypatch.setenv("HETEROPLANE_URL", url)
            monkeypatch.setenv("HETEROPLANE_TOKEN", admin)
            for path in (model, _same_weights(model)):
                _cli(capsys, "model", "push", MODEL, str(path))
            _serve(first, [MODEL], profile_file(tmp_path))
            client = Client(url, infer)
            client.start()
            try:
                # A long interval: the first step is still going when the service stops.
                started = _cli(
                    capsys, "rollout", "start", "--app", APP, "--model", f"{MODEL}@2",
                    "--steps", "50,100", "--interval-s", "3", "--min-queries", "5",
                )  # fmt: skip
                running = _wait_rollout(capsys, lambda s: s["state"] == "running")
                assert running["step_index"] == 0
            finally:
                client.stop.set()
                client.join(timeout=60.0)
                statuses.update(client.statuses)
        first.close()
        prefix = f"profile:rollout-{APP}-{started['id']}-"
        second = build_service(Settings(data_dir=data_dir, provisioner="local", reconcile_s=0.5))
        provisioner = second.provisioner
        try:
            with ApiServer(second) as url:
                monkeypatch.setenv("HETEROPLANE_URL", url)
                client = Client(url, infer)
                client.start()
                try:
                    done = _wait_rollout(capsys, lambda s: s["state"] != "running")
                    assert done["state"] == "promoted", done
                    assert done["id"] == started["id"]
                finally:
                    client.stop.set()
                    client.join(timeout=60.0)
                    statuses.update(client.statuses)
            rows = [r for r in second.store.list_instances(APP) if r.request_id.startswith(prefix)]
            assert len(rows) == 1, rows  # the same worker, not launched again
            reasons = [d.reason for d in second.store.list_decisions(APP, kinds=["rollout"])]
            assert sum("workers of the new version running" in r for r in reasons) == 1, reasons
        finally:
            stop_every_worker(second.provisioner)
            second.close()
    except BaseException:
        if isinstance(provisioner, LocalProvisioner):
            stop_every_worker(provisioner)
        raise
    assert statuses[200] > 0 and set(statuses) == {200}, statuses
