"""The store: the one place the service reads and writes its database.

The API, the scheduler's jobs and the CLI call :class:`Store`; ORM rows never leave this package:
every method returns frozen records (:class:`AppRecord`, :class:`PlanRecord`, ...) or plain
values, and every database failure is a one-line :class:`~controlplane.errors.DatabaseError`.

Concurrency (docs/service.md, "Concurrency"):

- An app row carries ``version``; every change of it (spec, budget, applied plan) bumps it with
  ``UPDATE apps SET ..., version = version + 1 WHERE id = :id AND version = :seen``, so of two
  writers that saw the same version exactly one updates a row. :meth:`Store.apply_plan` turns a
  lost race into :class:`~controlplane.errors.ConflictError`: a plan records the app version it
  was made for, and is applied only while the app is still at that version (a plan made before a
  budget or spec change, or before another plan was applied, is stale). :meth:`Store.change_budget`
  retries a lost race instead, so concurrent budget changes serialise: each audit row's old budget
  is the previous row's new one.
- A launch is idempotent by its request id: :meth:`Store.record_instance` with a request id seen
  before returns the instance recorded then (a unique constraint settles a race).
- Instance state moves follow :mod:`controlplane.policies.lifecycle`, compare-and-set on the state
  seen.

Lists come oldest first; with ``limit`` they hold the newest ``limit`` items (still oldest first);
``since`` is exclusive. Times are timezone-aware UTC; by default they are read from the clock the
store was given.

One module per aggregate, each a part of :class:`Store` over the same engine and sessions
(:class:`~controlplane.db.store.base.StoreBase`; every method is its own transaction):
:mod:`~controlplane.db.store.apps` (apps and budgets), :mod:`~controlplane.db.store.plans`,
:mod:`~controlplane.db.store.instances`, :mod:`~controlplane.db.store.calibration` (profile
scales, serving overhead, measured profiles), :mod:`~controlplane.db.store.model_versions` (the
registry's rows), :mod:`~controlplane.db.store.decisions`, :mod:`~controlplane.db.store.metrics`,
:mod:`~controlplane.db.store.tokens` (with its cache, :mod:`~controlplane.db.store.token_cache`),
:mod:`~controlplane.db.store.dashboard_sessions`, :mod:`~controlplane.db.store.rollouts` and
:mod:`~controlplane.db.store.dispatchers` (which serving process dispatches each app); the
records they return are in :mod:`~controlplane.db.store.records` (a rollout's in its module).
"""

from __future__ import annotations

from controlplane.db.store.apps import AppStore
from controlplane.db.store.base import DECISION_MERGE_WINDOW_S
from controlplane.db.store.calibration import CalibrationStore
from controlplane.db.store.dashboard_sessions import DashboardSessionStore
from controlplane.db.store.decisions import DecisionStore
from controlplane.db.store.dispatchers import DispatcherRecord, DispatcherStore
from controlplane.db.store.instances import InstanceStore
from controlplane.db.store.metrics import MetricStore
from controlplane.db.store.model_versions import ModelVersionStore
from controlplane.db.store.plans import PlanStore
from controlplane.db.store.records import (
    AppRecord,
    BudgetChangeRecord,
    DecisionRecord,
    InstanceEventRecord,
    InstanceRecord,
    MetricSampleRecord,
    ModelVersionRecord,
    PlanRecord,
    Principal,
    ProfileScaleRecord,
    ServingOverheadRecord,
    TokenRecord,
)
from controlplane.db.store.rollouts import RolloutRecord, RolloutStore
from controlplane.db.store.token_cache import TOKEN_CACHE_MAX, TOKEN_CACHE_S
from controlplane.db.store.tokens import LAST_USED_RESOLUTION_S, TokenStore

__all__ = [
    "DECISION_MERGE_WINDOW_S",
    "LAST_USED_RESOLUTION_S",
    "TOKEN_CACHE_MAX",
    "TOKEN_CACHE_S",
    "AppRecord",
    "BudgetChangeRecord",
    "DecisionRecord",
    "DispatcherRecord",
    "InstanceEventRecord",
    "InstanceRecord",
    "MetricSampleRecord",
    "ModelVersionRecord",
    "PlanRecord",
    "Principal",
    "ProfileScaleRecord",
    "RolloutRecord",
    "ServingOverheadRecord",
    "Store",
    "TokenRecord",
]


class Store(
    AppStore,
    PlanStore,
    InstanceStore,
    CalibrationStore,
    ModelVersionStore,
    DecisionStore,
    MetricStore,
    TokenStore,
    DashboardSessionStore,
    RolloutStore,
    DispatcherStore,
):
    """Reads and writes of the control plane's database (see the package docstring): every
    aggregate's part, over one engine."""
