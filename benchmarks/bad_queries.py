"""Bad queries beside a good load: does one poison query a second make good queries fail?

    .venv/bin/python benchmarks/bad_queries.py [--json] [--rate-qps 100] [--duration-s 20]
        [--poison-every-s 1]

What runs: ``heteroplane serve`` with the local provisioner (``benchmarks/local_service.py``); a
user's model it has never seen, pushed with ``heteroplane model push``: a bag-of-tokens
classifier (an embedding of a 10-token vocabulary, INT64 token ids [N, 4], averaged, a linear
layer to three scores; seeded weights) exported to ONNX; an app of it on one ``emu.cpu.large``
worker, which pads a batch of b rows to 10 + 0.5 b ms (the local provisioner's emulation; the
app's profile file says the same, so its plan batches): at 100 q/s queries queue and go in
batches of several, poison among them. (Until 2026-12-06 the worker answered in about a
millisecond and the plan's batch was 1: no poison query ever shared a batch.) The good load is
``heteroplane loadgen``'s open loop over ``/v2`` (a Poisson trace at ``--rate-qps`` for
``--duration-s``, rows of valid tokens from a ``.npz``); beside it, every ``--poison-every-s``
seconds one query over ``/v2`` whose tokens include one outside the vocabulary (the model
raises on it: onnxruntime's Gather).

Printed: the good load's summary (sent, answered, errors by kind, p50, p99), the poison queries'
answers by status and how many of them the worker refused in a batch of several (its message
names the batch's rows), whether the worker stayed healthy and the ``worker_unhealthy`` decisions
recorded. Goal (issue 30): 0 good queries fail. Before issue 30 a model error marked the worker
unhealthy for about a second, and one such query a second made most concurrent good queries
fail with 503.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import numpy as np

try:  # imported as benchmarks.bad_queries
    from benchmarks import local_service
except ModuleNotFoundError:  # run as a script: the sibling module
    import local_service  # type: ignore[no-redef]

from controlplane.clients import loadgen
from controlplane.clients.tensors import InputSpec
from estimator.traces import Trace, poisson_arrivals

APP = "tokens"
MODEL = "bag-of-tokens"
INSTANCE_TYPE = "emu.cpu.large"
VOCABULARY = 10
TOKENS = 4
SPECS = [InputSpec("tokens", "INT64", (-1, TOKENS))]


def export_model(folder: Path) -> Path:
    """The bag-of-tokens model (seeded weights), exported to ONNX."""
    import torch

    class BagOfTokens(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = torch.nn.Embedding(VOCABULARY, 8)
            self.out = torch.nn.Linear(8, 3)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.out(self.embedding(tokens).mean(dim=1))

    torch.manual_seed(0)
    path = folder / "tokens.onnx"
    torch.onnx.export(
        BagOfTokens().eval(),
        (torch.zeros((2, TOKENS), dtype=torch.int64),),
        str(path),
        dynamo=False,
        input_names=["tokens"],
        output_names=["scores"],
        dynamic_axes={"tokens": {0: "batch"}, "scores": {0: "batch"}},
    )
    return path


def profile_file(folder: Path, sizes: tuple[int, ...] = (1, 2, 4, 8)) -> Path:
    """A profile of the model on the worker's type at batch sizes ``sizes`` (the numbers only
    plan), ``folder/profiles.json``."""
    path = folder / "profiles.json"
    entry = {
        "model": MODEL,
        "instance_type": INSTANCE_TYPE,
        "batch_sizes": list(sizes),
        "latency_ms": [1.0 + 0.1 * b for b in sizes],
    }
    path.write_text(json.dumps({"profiles": [entry]}))
    return path


# The benchmark's worker pads a batch of b rows to SERVICE_MS + ROW_MS * b (the local
# provisioner's emulation): at 100 q/s a batch of one would not keep up, so queries queue and go
# in batches of several, poison among them, as the app's plan (the same curve) expects.
SERVICE_MS = 10.0
ROW_MS = 0.5
SIZES = (1, 2, 4, 8)


def service_curves(data_dir: Path) -> Path:
    """The curves the workers pad to (:data:`SERVICE_MS`, :data:`ROW_MS`) in the data
    directory's profile file, which the local provisioner hands its workers, and the same
    numbers as the app's profile file, ``data_dir/profiles.json``: the latter's path."""
    from controlplane.provisioning import LOCAL_PROFILE_FILE
    from estimator.profiles import LatencyProfile, write_profiles_json

    sizes = np.array(SIZES)
    cells = tuple(np.full(8, SERVICE_MS + ROW_MS * b) for b in SIZES)
    emulated = data_dir / LOCAL_PROFILE_FILE
    emulated.parent.mkdir(parents=True, exist_ok=True)
    profiles = [LatencyProfile(MODEL, INSTANCE_TYPE, sizes, cells)]
    write_profiles_json(profiles, emulated, source="benchmarks/bad_queries.py")
    path = data_dir / "profiles.json"
    entry = {
        "model": MODEL,
        "instance_type": INSTANCE_TYPE,
        "batch_sizes": list(SIZES),
        "latency_ms": [SERVICE_MS + ROW_MS * b for b in SIZES],
    }
    path.write_text(json.dumps({"profiles": [entry]}))
    return path


def app_spec(data_dir: Path) -> dict[str, Any]:
    """The app of the model on one worker, its profiles written to the service's data directory
    ``data_dir`` (:func:`service_curves`): the API refuses a spec naming a file elsewhere."""
    profiles = service_curves(data_dir)
    return {
        "name": APP,
        "models": [{"name": MODEL, "artifact": MODEL, "profiles": str(profiles)}],
        "slo": {"latency_ms": 200, "percentile": 99},
        "budget_usd_per_hr": 0.2,
        "instance_types": [INSTANCE_TYPE],
        "max_counts": {INSTANCE_TYPE: 1},
    }


_SHARED = re.compile(r"failed on \d+ of (\d+) rows")


def poison_sender(
    url: str, token: str, every_s: float, stop: threading.Event, statuses: Counter[str]
) -> None:
    """One query a tick with a token outside the vocabulary, until ``stop``; ``statuses``
    counts the answers by status, and as ``shared`` those the worker refused in a batch of
    several (its message: "failed on 1 of 3 rows")."""
    rng = np.random.default_rng(1)
    with httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=30.0) as client:
        while not stop.wait(every_s):
            tokens = rng.integers(0, VOCABULARY, size=TOKENS).tolist()
            tokens[0] = VOCABULARY + int(rng.integers(0, 1000))
            body = {"inputs": [{"name": "tokens", "datatype": "INT64", "shape": [1, 4]}]}
            body["inputs"][0]["data"] = tokens
            try:
                answer = client.post(url, json=body)
            except httpx.HTTPError as error:
                statuses[type(error).__name__] += 1
                continue
            statuses[str(answer.status_code)] += 1
            shared = _SHARED.search(answer.text)
            if shared is not None and int(shared.group(1)) > 1:
                statuses["shared"] += 1


def measure(rate_qps: float, duration_s: float, poison_every_s: float) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="heteroplane-bad-queries-"))
    data_dir = root / "data"
    data_dir.mkdir()
    try:
        model = export_model(root)
        spec = app_spec(data_dir)  # before the service: its provisioner reads the curves then
        token = local_service.issue_token(data_dir, "bad-queries")
        port = local_service.free_port()
        base = f"http://127.0.0.1:{port}"
        settings = {"HETEROPLANE_REPLAN_ENABLED": "false"}
        with local_service.serving_api(data_dir, port, token, model=MODEL, settings=settings) as (
            process,
            api,
            log_path,
        ):
            env = local_service.clean_env(HETEROPLANE_URL=base, HETEROPLANE_TOKEN=token)
            subprocess.run(
                [sys.executable, "-m", "controlplane", "model", "push", MODEL, str(model)],
                check=True,
                env=env,
                capture_output=True,
            )
            api.post("/v1/apps", json=spec).raise_for_status()
            preview = api.post(f"/v1/apps/{APP}/plans", json={"rate_qps": rate_qps})
            preview.raise_for_status()
            plan = preview.json()
            api.post(f"/v1/apps/{APP}/plans/{plan['id']}/apply").raise_for_status()

            def running() -> bool:
                rows = api.get("/v1/instances", params={"app": APP}).json()
                return any(r["state"] == "running" for r in rows)

            local_service.wait_for("the worker", running, process, log_path)
            ready = f"/v2/models/{APP}/ready"
            local_service.wait_for(
                "readiness", lambda: api.get(ready).status_code == 200, process, log_path
            )
            rng = np.random.default_rng(0)
            rows = {"tokens": rng.integers(0, VOCABULARY, size=(256, TOKENS))}
            arrivals = poisson_arrivals(rate_qps, duration_s, rng)
            trace = Trace(arrivals, np.ones(arrivals.size, dtype=np.int64))
            queries = loadgen.build_tensor_queries(trace, rows, SPECS, "v2")
            infer = loadgen.infer_url(base, APP, "v2")
            stop = threading.Event()
            poison: Counter[str] = Counter()
            sender = threading.Thread(
                target=poison_sender, args=(infer, token, poison_every_s, stop, poison)
            )
            sender.start()
            try:
                result = loadgen.run_load(queries, infer, token, engine="raw")
            finally:
                stop.set()
                sender.join()
            status = api.get(f"/v1/apps/{APP}/serving").json()
            decisions = api.get(
                f"/v1/apps/{APP}/decisions", params={"kind": "worker_unhealthy"}
            ).json()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = result.summary(None).to_json()
    return {
        "rate_qps": rate_qps,
        "duration_s": duration_s,
        "poison_every_s": poison_every_s,
        "good": summary,
        "good_failed": summary["errors"],
        "poison_answers": {k: v for k, v in poison.items() if k != "shared"},
        "poison_in_batches_of_several": poison["shared"],
        "workers_healthy": all(w["healthy"] for w in status["workers"]),
        "worker_unhealthy_decisions": len(decisions),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "goal_met": summary["errors"] == 0,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate-qps", type=float, default=100.0)
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--poison-every-s", type=float, default=1.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    started = time.monotonic()
    result = measure(args.rate_qps, args.duration_s, args.poison_every_s)
    result["wall_s"] = round(time.monotonic() - started, 1)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    good = result["good"]
    print(
        f"good load: {good['sent']} sent at {args.rate_qps:g} q/s, {good['answered']} answered,"
        f" errors {good['errors']} {good['errors_by_kind']}; p50 {good['p50_ms']:.1f} ms,"
        f" p99 {good['p99_ms']:.1f} ms"
    )
    print(
        f"poison queries (one every {args.poison_every_s:g} s): {result['poison_answers']}"
        f" ({result['poison_in_batches_of_several']} in batches of several);"
        f" worker healthy: {result['workers_healthy']}, worker_unhealthy decisions:"
        f" {result['worker_unhealthy_decisions']}"
    )
    print(f"goal, 0 good queries fail: {'met' if result['goal_met'] else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
