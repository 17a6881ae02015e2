"""How fast is the serving path, and where does a request's time go?

    .venv/bin/python -m benchmarks.serving_speed dispatcher [--quick] [--scenario S] [--json]
    .venv/bin/python -m benchmarks.serving_speed api [--rate-qps R] [--runs N] [--protocols v1,v2]
        [--json]
    .venv/bin/python -m benchmarks.serving_speed layers [--quick] [--json]

Three depths of one path, each a part (``PART --help`` lists its options):

- ``dispatcher``: the serving loop's dispatcher alone, with its real HTTP transport to fake
  workers in this process: the rate it sustains and the latency it adds (goal: >= 2,000 q/s at
  <= 5 ms added P99; :mod:`benchmarks.serving_speed.dispatcher`);
- ``api``: the whole service where clients enter (``heteroplane serve``, real worker agents,
  the raw load generator in a process of its own): the same figures end to end, on ``/v1`` and
  on ``/v2`` (goal: >= 2,000 q/s at <= 3 ms added P99 on both;
  :mod:`benchmarks.serving_speed.api`);
- ``layers``: the CPU each layer of an inference request costs, in process (JSON, the token
  check, FastAPI's route against the fast path on ``/v1`` and ``/v2``, uvicorn's HTTP):
  :mod:`benchmarks.serving_speed.layers`.
"""
