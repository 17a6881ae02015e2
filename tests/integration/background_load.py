"""Open-loop traffic for the integration tests: ``controlplane.clients.loadgen`` in a thread."""

from __future__ import annotations

import threading

import numpy as np

from controlplane.clients import loadgen
from estimator.traces import Trace, poisson_arrivals

__all__ = ["BackgroundLoad"]


class BackgroundLoad:
    """Poisson traffic to ``app`` on the service at ``url``, one phase at a time: each phase is a
    trace of ``duration_s`` at its rate (the family's validation digits), sent open loop until
    the next phase starts or :meth:`stop`. ``results`` holds each phase's (rate, result)."""

    def __init__(self, url: str, app: str, token: str, duration_s: float) -> None:
        from provisioners.worker.family import load_split

        self.url = loadgen.infer_url(url, app)
        self.token = token
        self.duration_s = duration_s
        self.inputs = load_split().validation_inputs
        self.results: list[tuple[float, loadgen.LoadResult]] = []
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def result(self) -> loadgen.LoadResult | None:
        """The last finished phase's result."""
        return self.results[-1][1] if self.results else None

    def phase(self, rate_qps: float, seed: int) -> None:
        self.stop()
        arrivals = poisson_arrivals(rate_qps, self.duration_s, np.random.default_rng(seed))
        queries = loadgen.build_queries(
            Trace(arrivals, np.ones(arrivals.size, dtype=np.int64)), self.inputs
        )
        self._stop = threading.Event()
        stop = self._stop

        def send() -> None:
            result = loadgen.run_load(queries, self.url, self.token, stop=stop)
            self.results.append((rate_qps, result))

        self._thread = threading.Thread(target=send, name=f"loadgen-{rate_qps:g}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=120.0)
            assert not self._thread.is_alive(), "loadgen did not stop"
            self._thread = None
