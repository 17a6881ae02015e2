"""Does the service tell the truth: do the planner's predictions and the service's own counts match
what a client measures?

    .venv/bin/python -m benchmarks.fidelity serving [--service-ms 5,15,50] [--user-model json]
        [--runs 3] [--save FILE] [--from FILE] [--json]
    .venv/bin/python -m benchmarks.fidelity demo [--runs N] [--duration-s S] [--json]
    .venv/bin/python -m benchmarks.fidelity cycle [--cycles N] [--json]

Each part runs the live service and a client against it (``PART --help`` lists its options):

- ``serving``: the planner's predicted P99 against the P99 measured on a controlled app (one
  emulated instance computing in 5, 15 or 50 ms, and a user's ONNX CNN pushed to the registry and
  queried over ``/v2``; loads at a share of the plan's capacity; InferLine's Figure 9):
  :mod:`benchmarks.fidelity.serving`;
- ``demo``: the same for the demo's cascade at its applied plan's rate, as ``make demo`` serves
  it: :mod:`benchmarks.fidelity.demo`;
- ``cycle``: one demo load cycle replayed from the client: whether the service's count of late
  or failed queries matches the client's (within 1%) and whether the fleet grows and shrinks:
  :mod:`benchmarks.fidelity.cycle`.

``serving`` writes docs/serving-fidelity.md; ``demo`` and ``cycle`` print their section of it.
"""
