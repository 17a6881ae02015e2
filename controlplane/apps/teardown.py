"""Use case: take an app down: drain all its instances, then delete it (``heteroplane app down``,
``DELETE /v1/apps/{app}?drain=true``, ``heteroplane demo --down``).

:func:`request_teardown` deletes an app with no live instance at once; otherwise it marks the
app for teardown and returns: the reconciler (:mod:`controlplane.loops.reconciler`, "Teardown")
ends every instance of an app so marked at once, launches nothing for it, and deletes the app
once none is live. The caller waits for the app to be gone (the command line polls).

The mark is a ``teardown`` decision in the app's decision log (no column of its own: the
decision log is where the reconciler's reasons live, and it names who asked and when). An app is
being torn down while its newest ``teardown`` decision is newer than its newest budget change:
setting a budget again (``heteroplane budget set``) is how a teardown is called off, and the
reconciler then brings the applied plan's fleet back. docs/operations.md says why this design.
"""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.crashpoints import crash_point
from controlplane.db.store import AppRecord, InstanceRecord, Store
from controlplane.errors import ConflictError
from controlplane.policies.lifecycle import LIVE_STATES

__all__ = [
    "TEARDOWN_KIND",
    "Teardown",
    "refuse_torn_down",
    "request_teardown",
    "teardown_requested",
]

# The decision that marks an app for teardown.
TEARDOWN_KIND = "teardown"


@dataclass(frozen=True, slots=True)
class Teardown:
    """What :func:`request_teardown` did: ``deleted`` (the app had no live instance and is
    gone), or marked the app, whose ``live`` instances the reconciler now drains."""

    app: str
    deleted: bool
    live: tuple[InstanceRecord, ...]

    def describe(self) -> str:
        """One line for the caller."""
        if self.deleted:
            return f"app {self.app} had no live instance: deleted"
        return (
            f"app {self.app}: draining {len(self.live)} instance(s) at once; the app is deleted"
            " when none is left (a budget change calls it off)"
        )


def _live(store: Store, app: str) -> list[InstanceRecord]:
    return store.list_instances(app, states=[s.value for s in LIVE_STATES])


def request_teardown(store: Store, app: str, who: str) -> Teardown:
    """Delete ``app`` if it has no live instance, else mark it for teardown (a ``teardown``
    decision naming ``who``). Asking again while a teardown runs marks it again (one decision,
    counted twice).

    Raises:
        NotFoundError: no such app.
    """
    live = _live(store, app)
    if not live:
        try:
            store.delete_app(app)
            return Teardown(app, True, ())
        except ConflictError:
            live = _live(store, app)  # a launch was recorded meanwhile: drain it too
    store.record_decision(
        app,
        TEARDOWN_KIND,
        f"app down by {who}: drain {len(live)} instance(s) at once, then delete the app",
        {"who": who, "instance_ids": [i.id for i in live]},
        key=TEARDOWN_KIND,
    )
    crash_point("app_down.after_mark")
    return Teardown(app, False, tuple(live))


def teardown_requested(store: Store, app: AppRecord) -> bool:
    """Whether ``app`` is marked for teardown: its newest ``teardown`` decision is newer than its
    newest budget change (see the module docstring)."""
    marks = store.list_decisions(app.name, kinds=[TEARDOWN_KIND], limit=1)
    if not marks:
        return False
    mark = marks[-1]
    marked_at = mark.at if mark.last_at is None else mark.last_at
    changes = store.list_budget_changes(app.name, limit=1)
    return not changes or changes[-1].at <= marked_at


def refuse_torn_down(store: Store, record: AppRecord, what: str) -> None:
    """:class:`ConflictError` (``what`` says what is refused) when ``record``'s app is being
    taken down (``heteroplane app down``): nothing is launched for an app about to go, as a
    plan is not applied to it."""
    if teardown_requested(store, record):
        raise ConflictError(
            f"app {record.name!r} is being taken down (heteroplane app down): {what}; set its"
            " budget again (heteroplane budget set) to call the teardown off"
        )
