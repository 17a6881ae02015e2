"""The serving loop: queries in through ``POST /v1/apps/{app}/infer``, out to the workers.

Layout: ``loop`` (:class:`~controlplane.serving.loop.ServingLoop`, every app's dispatcher, kept in
step with the store and the fleet, started and stopped with the API), ``dispatcher`` (one app's
hot path: central queues per stage, the matching policy the simulator runs, batches to workers,
answers, cascades, failed batches), which composes ``placement`` (which workers serve which
stage, under which policy), ``health`` (unhealthy marking, retries, probes) and ``variants``
(model-less variant choice, INFaaS states, the loads admission judges) over ``stages`` (a stage's
queue, slots and latency tables) and ``config`` (what a dispatcher is given); ``workers`` (where
the workers are, their backoff), ``transport`` (kept-alive HTTP/1.1 to the worker agents),
``admission`` (429 when the queue cannot be served within the SLO), ``states`` (INFaaS's active /
overloaded / interfered) and ``observations`` (arrivals for the tuner, windows for the roll-up,
counters for ``/metrics``). docs/serving.md tells the whole story.
"""

from __future__ import annotations
