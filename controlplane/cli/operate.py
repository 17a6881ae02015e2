"""The operator's commands against a running service (REST API, docs/api.md):

- ``heteroplane app apply -f spec.yaml`` (register, or replace the spec of an app that exists),
  ``app list``, ``app get NAME``, ``app delete NAME [--force]``, ``app down NAME [--no-wait]``
  (drain every instance, then delete the app; waits with a line per change of the fleet);
- ``heteroplane plans preview --app APP --rate-qps R`` (or a gamma trace), ``plans list``,
  ``plans apply --app APP --id ID``: named ``plans`` because ``heteroplane plan`` is the offline
  planner on a spec file and a trace file;
- ``heteroplane budget get --app APP``, ``budget set --app APP --usd-per-hr X --reason R
  [--force]`` (``--force`` sends ``"force": true``: a budget below the smallest serving fleet, or
  one that buys no instance);
- ``heteroplane fleet [--app APP]``;
- ``heteroplane events --app APP [--kind K[,K]] [--exclude-kind K[,K]] [--no-collapse]``
  (decisions and instance events, in time order; a run of the same kind is one line with its
  count and time span).

Each prints a table or a summary, or with ``--json`` the server's JSON as one object. Their
parsers are in :mod:`controlplane.cli.parsers`; the transport and the shared options are
:mod:`controlplane.cli.client`. Nothing here, nor there, imports more than httpx, so that these
commands start fast (docs/cli.md).
"""

from __future__ import annotations

import argparse
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from controlplane.cli.client import (
    ApiClient,
    ApiClientError,
    app_path,
    client_from,
    table,
)
from controlplane.cli.output import UsageError, emit, progress, rate_text
from controlplane.policies.rollout_states import decision_subject
from estimator.numbers import plain

__all__ = [
    "app_apply",
    "app_delete",
    "app_down",
    "app_get",
    "app_list",
    "budget_get",
    "budget_set",
    "collapse",
    "events",
    "fleet",
    "plans_apply",
    "plans_list",
    "plans_preview",
]


# --- app -------------------------------------------------------------------------------------


def _app_line(app: dict[str, Any]) -> str:
    plan = app["applied_plan_id"]
    return (
        f"{app['name']}: budget ${plain(app['budget_usd_per_hr'])}/hr, version {app['version']},"
        f" {'plan ' + str(plan) + ' applied' if plan is not None else 'no plan applied'}"
    )


def app_apply(args: argparse.Namespace) -> int:
    # Here, not at the top: the spec module loads pydantic, which the other commands of this
    # module never need (resolving a spec, which loads numpy and numba, is the service's).
    from controlplane.spec import load_spec

    spec = load_spec(args.file)
    document = spec.model_dump(mode="json", exclude_none=True)
    with client_from(args) as client:
        try:
            app = client.get(app_path(spec.name))
        except ApiClientError as error:
            if error.status != 404:
                raise
            app = None
        if app is None:
            app, verb = client.post("/v1/apps", document), "registered"
        elif app["spec"] != document:
            # The service answers an unchanged spec (the same once its artifacts are pinned:
            # `wine` is stored as `wine@1`) as it is, its version the same.
            before = app["version"]
            app = client.put(app_path(spec.name), document)
            verb = "updated" if app["version"] != before else "unchanged:"
        else:
            # Replacing a spec by itself would still bump the app's version and stale its plans.
            verb = "unchanged:"
    return emit(args.json, app, lambda: f"{verb} {_app_line(app)}")


def app_list(args: argparse.Namespace) -> int:
    with client_from(args) as client:
        apps = client.get("/v1/apps")
    rows = [
        [
            a["name"],
            a["budget_usd_per_hr"],
            a["version"],
            a["applied_plan_id"],
            ", ".join(m["name"] for m in a["spec"].get("models", [])),
        ]
        for a in apps
    ]
    return emit(
        args.json,
        {"apps": apps},
        lambda: (
            table(["APP", "BUDGET_USD_PER_HR", "VERSION", "PLAN", "MODELS"], rows)
            if rows
            else "no apps"
        ),
    )


def app_get(args: argparse.Namespace) -> int:
    with client_from(args) as client:
        app = client.get(app_path(args.name))
    return emit(args.json, app, lambda: _app_line(app))


def app_delete(args: argparse.Namespace) -> int:
    with client_from(args) as client:
        client.delete(app_path(args.name), force="true" if args.force else None)
    return emit(
        args.json, {"deleted": args.name}, lambda: f"deleted app {args.name} and its history"
    )


def _fleet_line(fleet: dict[str, Any]) -> str:
    """``3 instance(s) left: 2 terminating, 1 running``."""
    states: dict[str, int] = {}
    for row in fleet.get("by_type", []):
        for state, n in row.get("states", {}).items():
            states[state] = states.get(state, 0) + n
    detail = ", ".join(f"{n} {state}" for state, n in sorted(states.items()))
    return f"{fleet.get('instances', 0)} instance(s) left" + (f": {detail}" if detail else "")


def app_down(args: argparse.Namespace) -> int:
    """``DELETE /v1/apps/NAME?drain=true``, then (unless ``--no-wait``) the app's fleet every
    ``--poll-s`` until the app is gone (a 404), a line each time the fleet changes."""
    name = args.name
    with client_from(args) as client:
        answer = client.delete(app_path(name), drain="true")
        if answer is None:
            return emit(
                args.json,
                {"app": name, "deleted": True},
                lambda: f"app {name} had no live instance: deleted",
            )
        if args.no_wait:
            return emit(args.json, {**answer, "deleted": False}, lambda: str(answer["message"]))
        progress(str(answer["message"]))
        deadline_s = time.monotonic() + args.wait_s
        last = ""
        while True:
            try:
                fleet = client.get(app_path(name, "fleet"))
            except ApiClientError as error:
                if error.status == 404:
                    break
                raise
            line = _fleet_line(fleet)
            if line != last:
                progress(f"app {name}: {line}")
                last = line
            if time.monotonic() >= deadline_s:
                raise ApiClientError(
                    f"app {name} is still draining after {args.wait_s:g} s ({line}); the"
                    f" service goes on: see heteroplane fleet --app {name}"
                )
            time.sleep(args.poll_s)
    drained = len(answer.get("instances", []))
    return emit(
        args.json,
        {"app": name, "deleted": True, "drained": drained},
        lambda: f"app {name}: {drained} instance(s) drained; the app is deleted",
    )


# --- plans -----------------------------------------------------------------------------------


def _plan_text(plan: dict[str, Any]) -> str:
    verdict = (
        f"feasible at ${plan['cost_usd_per_hr']:.3f}/hr"
        if plan["feasible"]
        else f"NOT feasible: at most {rate_text(plan.get('max_feasible_qps') or 0.0)} qps can be"
        " served"
    )
    lines = [
        f"plan {plan['id']} of {plan['app']} ({plan['status']}): {verdict}",
        f"  planned for {rate_text(_plan_rate_qps(plan))} qps: predicted end-to-end P99"
        f" {_predicted_text(plan.get('predicted_p99_ms'))}",
    ]
    trace = plan.get("trace")
    if trace:
        lines.append(f"  trace: {trace['count']:,} queries, {trace['source']}")
    for s in plan["stages"]:
        fleet = ", ".join(f"{n} x {t}" for t, n in s["fleet"].items())
        lines.append(
            f"  {s['name']}: {fleet}, batch {s['batch_size']}, {s['policy']} dispatch;"
            f" P99 {s['predicted_p99_ms']:.1f} ms, {rate_text(s['throughput_qps'])} qps,"
            f" ${s['cost_usd_per_hr']:.3f}/hr"
        )
    lines += [f"  - {step}" for step in plan["steps"]]
    return "\n".join(lines)


def _plan_rate_qps(plan: dict[str, Any]) -> float:
    """The rate a plan is planned for (``planned_rate_qps`` in documents older than
    ``rate_qps``)."""
    rate = plan.get("rate_qps")
    return float(rate if rate is not None else plan.get("planned_rate_qps") or 0.0)


def _predicted_text(value: object) -> str:
    """The end-to-end prediction, or why there is none."""
    if isinstance(value, int | float):
        return f"{value:.1f} ms (the whole pipeline)"
    return "n/a (a plan without stages, or one made before plans carried it)"


def plans_preview(args: argparse.Namespace) -> int:
    trace: dict[str, Any] = {"rate_qps": args.rate_qps, "seed": args.seed}
    if args.cv2 is not None:
        trace |= {"kind": "gamma", "cv2": args.cv2}
    if args.duration is not None:
        trace["duration_s"] = args.duration
    if args.batch_dist is not None:
        trace["batch_dist"] = args.batch_dist
    with client_from(args) as client:
        plan = client.post(app_path(args.app, "plans"), {"trace": trace, "seed": args.seed})
    if plan.get("stages"):
        hint = f"apply it with: heteroplane plans apply --app {args.app} --id {plan['id']}"
    else:
        # The service refuses to apply it (409: it would drain every instance).
        hint = (
            "it has no stages (no rate can be served within the budget and the SLO), so it"
            " cannot be applied: raise the budget or loosen the SLO and preview another"
        )
    return emit(args.json, plan, lambda: f"{_plan_text(plan)}\n{hint}")


def plans_list(args: argparse.Namespace) -> int:
    with client_from(args) as client:
        plans = client.get(app_path(args.app, "plans"))
    rows = [
        [
            p["id"],
            p["status"],
            "yes" if p["feasible"] else "no",
            p["cost_usd_per_hr"],
            _plan_rate_qps(p),
            p.get("predicted_p99_ms"),  # None ("-"): no stages, or an older plan
            p["created_at"],
        ]
        for p in plans
    ]
    headers = [
        "ID",
        "STATUS",
        "FEASIBLE",
        "COST_USD_PER_HR",
        "RATE_QPS",
        "PREDICTED_P99_MS",
        "CREATED",
    ]
    return emit(
        args.json,
        {"plans": plans},
        lambda: table(headers, rows) if rows else f"no plans for {args.app}",
    )


def plans_apply(args: argparse.Namespace) -> int:
    """``POST .../plans/ID/apply``; with ``--wait``, then ``GET /v2/models/APP/ready`` every
    ``--poll-s`` until it answers 200 (a worker serves the app), for at most ``--timeout-s``."""
    with client_from(args) as client:
        plan = client.post(app_path(args.app, "plans", str(args.id), "apply"))
        if args.wait:
            progress(f"plan {plan['id']} applied; waiting for a worker to serve {args.app}")
            waited_s = _wait_until_served(client, args.app, args.timeout_s, args.poll_s)
            plan = {**plan, "waited_s": round(waited_s, 3)}
    return emit(
        args.json,
        plan,
        lambda: (
            _plan_text(plan)
            + (f"\n{args.app} serves (after {waited_s:.1f} s)" if args.wait else "")
        ),
    )


def _wait_until_served(client: ApiClient, app: str, timeout_s: float, poll_s: float) -> float:
    """Seconds until ``/v2/models/APP/ready`` answered 200; ApiClientError (one line) after
    ``timeout_s`` of 503s, with the service's last reason."""
    path = "/v2/models/" + urllib.parse.quote(app, safe="") + "/ready"
    started_s = time.monotonic()
    while True:
        try:
            client.get(path)
            return time.monotonic() - started_s
        except ApiClientError as error:
            if error.status == 403:
                raise ApiClientError(f"--wait asks GET {path}: {error}", 403) from None
            if error.status != 503:
                raise
            reason = str(error)
        if time.monotonic() - started_s >= timeout_s:
            raise ApiClientError(
                f"{app} is not served after {timeout_s:g} s ({reason}); the plan stays applied:"
                f" see heteroplane fleet --app {app}"
            )
        time.sleep(poll_s)


# --- budget ----------------------------------------------------------------------------------


def budget_get(args: argparse.Namespace) -> int:
    with client_from(args) as client:
        budget = client.get(app_path(args.app, "budget"))

    def human() -> str:
        head = (
            f"{budget['app']}: budget ${plain(budget['budget_usd_per_hr'])}/hr, fleet costs"
            f" ${budget['fleet_cost_usd_per_hr']:.3f}/hr"
        )
        rows = [
            [c["at"], c["who"], c["old_usd_per_hr"], c["new_usd_per_hr"], c["reason"]]
            for c in budget["changes"]
        ]
        return head + "\n" + table(["AT", "WHO", "OLD", "NEW", "REASON"], rows)

    return emit(args.json, budget, human)


def budget_set(args: argparse.Namespace) -> int:
    with client_from(args) as client:
        body: dict[str, Any] = {"budget_usd_per_hr": args.usd_per_hr, "reason": args.reason}
        if args.force:
            # Only when asked: the budget change without it is what every server accepts.
            body["force"] = True
        try:
            answer = client.put(app_path(args.app, "budget"), body)
        except ApiClientError as error:
            # The API's words for its own body; on the command line the switch is --force.
            text = str(error).replace('send "force": true', "pass --force")
            if text == str(error):
                raise
            raise ApiClientError(text, error.status, error.code) from None

    def human() -> str:
        previous = answer["previous_usd_per_hr"]
        lines = [
            f"{answer['app']}: budget ${plain(answer['budget_usd_per_hr'])}/hr"
            + (f" (was ${plain(previous)}/hr)" if previous is not None else "")
            + f"; fleet costs ${answer['fleet_cost_usd_per_hr']:.3f}/hr"
        ]
        if answer["drain"]:
            lines.append(answer["note"])
            rows = [
                [d["id"], d["provider_id"], d["instance_type"], d["state"], d["price_usd_per_hr"]]
                for d in answer["drain"]
            ]
            lines.append(table(["ID", "PROVIDER_ID", "TYPE", "STATE", "USD_PER_HR"], rows))
        return "\n".join(lines)

    return emit(args.json, answer, human)


# --- fleet and events ------------------------------------------------------------------------


def _served_models(client: Any, app: str) -> dict[str, list[str]]:
    """Instance id -> the models the serving loop places on it (its stages' states); empty
    when the service runs no serving loop or has not served the app."""
    try:
        status = client.get(app_path(app, "serving"))
    except ApiClientError:
        return {}
    served: dict[str, list[str]] = {}
    for stage in status.get("stages", []):
        for instance_id in stage.get("states", {}):
            served.setdefault(str(instance_id), []).append(str(stage["model"]))
    return served


def _beside_the_fleet(instance: Mapping[str, Any]) -> str:
    """What an instance the app's stages do not place serves: a rollout's worker (its new
    version's queries, on the rollout's own dispatcher), a profile run's, or nothing yet.

    >>> [_beside_the_fleet(i) for i in ({"role": "rollout", "rollout_id": 3}, {"role": "fleet"})]
    ['rollout 3', '-']
    """
    role = instance.get("role")
    if role == "rollout":
        return f"rollout {instance.get('rollout_id')}"
    return "profile run" if role == "profile_run" else "-"


# The instance states `fleet` lists without --all: those not ended (the lifecycle's live states;
# the client commands do not import the policies, which the layers keep for the service).
LIVE_INSTANCE_STATES = ("requested", "pending", "running", "draining", "terminating")
FLEET_LIMIT_MAX = 10_000  # below the route's limit, which is asked for one more


def fleet(args: argparse.Namespace) -> int:
    if args.limit < 1 or args.limit > FLEET_LIMIT_MAX:
        raise UsageError(f"--limit must be 1 to {FLEET_LIMIT_MAX:,}, got {args.limit}")
    states = None if args.all else list(LIVE_INSTANCE_STATES)
    with client_from(args) as client:
        summary = client.get(app_path(args.app, "fleet")) if args.app else None
        # One more than shown, to say whether older ones were left out.
        instances = client.get("/v1/instances", app=args.app, state=states, limit=args.limit + 1)
        served = _served_models(client, args.app) if args.app else {}
    left_out = len(instances) > args.limit
    instances = instances[-args.limit :]

    def human() -> str:
        lines = []
        if summary is not None:
            lines.append(
                f"{summary['app']}: {summary['instances']} live instance(s),"
                f" ${summary['cost_usd_per_hr']:.3f}/hr of a"
                f" ${plain(summary['budget_usd_per_hr'])}/hr budget"
            )
            rows = [
                [
                    t["instance_type"],
                    t["count"],
                    t["price_usd_per_hr"],
                    t["cost_usd_per_hr"],
                    ", ".join(f"{n} {s}" for s, n in sorted(t["states"].items())),
                ]
                for t in summary["by_type"]
            ]
            if rows:
                lines.append(table(["TYPE", "COUNT", "PRICE", "COST", "STATES"], rows))
        rows = [
            [i["id"], i["app"], i["provider_id"], i["instance_type"], i["state"]] for i in instances
        ]
        headers = ["ID", "APP", "PROVIDER_ID", "TYPE", "STATE"]
        if served:  # which stage (model) each instance serves, as the serving loop placed it
            headers.append("SERVES")
            for row, i in zip(rows, instances, strict=True):
                row.append(", ".join(served.get(str(i["id"]), [])) or _beside_the_fleet(i))
        empty = "no instances" if args.all else "no live instances (--all: the ended ones too)"
        lines.append(table(headers, rows) if rows else empty)
        if left_out:
            lines.append(f"(the newest {args.limit} shown; --limit N for more)")
        return "\n".join(lines)

    data: dict[str, Any] = {"instances": instances}
    if served:
        data["serves"] = served
    if summary is not None:
        data["fleet"] = summary
    return emit(args.json, data, human)


# The kind that stands for the instances' lifecycle events in --kind and --exclude-kind (no
# decision has it).
INSTANCE_KIND = "instance"


@dataclass(frozen=True, slots=True)
class EventLine:
    """One line of ``heteroplane events``: a decision or an instance event, or a run of them of
    the same kind and ``subject`` (``count`` of them from ``at`` to ``last_at``; ``detail`` is
    the newest's). ``subject`` is what a decision is about where its numbers name one (a
    rollout's decisions: ``rollout 3``), so that two rollouts' decisions stay two lines."""

    at: str
    what: str
    kind: str
    detail: str
    count: int = 1
    last_at: str | None = None
    subject: str = ""


def _kind_list(values: Sequence[str] | None, option: str) -> list[str] | None:
    """The kinds of ``--kind a,b --kind c`` (None: not given); an empty name is a usage error."""
    if values is None:
        return None
    kinds = [name.strip() for value in values for name in value.split(",")]
    if not all(kinds):
        raise UsageError(f"{option}: a kind must not be empty, got {','.join(values)!r}")
    return kinds


def _instant(at: str) -> datetime:
    """An API time as a datetime: as strings, ``...:11Z`` would sort after ``...:11.1Z``."""
    return datetime.fromisoformat(at)


def collapse(lines: Sequence[EventLine]) -> list[EventLine]:
    """Each run of consecutive lines of the same (what, kind, subject) as one line: the counts
    summed (a decision the store merged already counts ``count``), from the first's ``at`` to
    the newest time seen, with the newest's detail.

    >>> one = EventLine("2026-01-01T00:00:00", "decision", "gear_switch", "up")
    >>> two = EventLine("2026-01-01T00:00:05", "decision", "gear_switch", "down", 2,
    ...                 "2026-01-01T00:00:09")
    >>> other = EventLine("2026-01-01T00:00:10", "decision", "scale_up", "need 3")
    >>> [(x.kind, x.count, x.last_at, x.detail) for x in collapse([one, two, other])]
    [('gear_switch', 3, '2026-01-01T00:00:09', 'down'), ('scale_up', 1, None, 'need 3')]
    >>> first = EventLine("2026-01-01T00:00:00", "decision", "rollout", "promoted",
    ...                   subject="rollout 1")
    >>> second = EventLine("2026-01-01T00:00:05", "decision", "rollout", "started",
    ...                    subject="rollout 2")
    >>> [x.subject for x in collapse([first, second])]
    ['rollout 1', 'rollout 2']
    """
    out: list[EventLine] = []
    for line in lines:
        before = out[-1] if out else None
        if before is None or (before.what, before.kind, before.subject) != (
            line.what,
            line.kind,
            line.subject,
        ):
            out.append(line)
            continue
        newest = line.last_at or line.at
        seen = before.last_at or before.at
        out[-1] = EventLine(
            before.at,
            line.what,
            line.kind,
            line.detail,
            before.count + line.count,
            max(seen, newest, key=_instant),
            line.subject,
        )
    return out


def _subject(decision: Mapping[str, Any]) -> str:
    """What ``decision`` is about, where its numbers say (``rollout 3``, or a cascade's
    ``stage medium`` for the tuner's decisions); else empty. A rollout's decision is about its
    state, step and, for a move, its reason too
    (:func:`~controlplane.policies.rollout_states.decision_subject`): each move is a line of its
    own, and only a wait said again collapses; until 2026-12-07 a whole rollout read as one
    line, its last move's.

    >>> _subject({"numbers": {"rollout_id": 3}}), _subject({"numbers": {"stage": "large"}})
    ('rollout 3', 'stage large')
    >>> _subject({"numbers": {"rollout_id": 3, "state": "running", "step_index": 1}})
    'rollout 3 running 1'
    >>> _subject({"numbers": {"rollout_id": 3, "state": "promoted", "step_index": 1,
    ...     "wait": False}, "reason": "rollout 3: handover done"})
    'rollout 3 promoted 1: rollout 3: handover done'
    """
    numbers = decision.get("numbers") or {}
    if not isinstance(numbers, Mapping):
        return ""
    rolled = decision_subject(numbers, decision.get("reason"))
    if rolled is not None:
        rollout, state, step, move = rolled
        subject = " ".join(str(x) for x in (f"rollout {rollout}", state, step) if x is not None)
        return subject if move is None else f"{subject}: {move}"
    stage = _stage(decision)
    return "" if stage is None else f"stage {stage}"


def _stage(decision: Mapping[str, Any]) -> str | None:
    """The stage (model) a tuner's decision is about, where its numbers name one."""
    numbers = decision.get("numbers") or {}
    stage = numbers.get("stage") if isinstance(numbers, Mapping) else None
    return stage if isinstance(stage, str) and stage else None


def _decision_detail(decision: Mapping[str, Any], staged: bool) -> str:
    """The decision's reason; ``staged`` (the decisions listed name more than one stage, a
    cascade's tuner), prefixed with its stage: a cascade's tuner decisions did not say which
    model they were about, and one stage's ran together with another's under one line."""
    reason = str(decision["reason"])
    stage = _stage(decision) if staged else None
    return reason if stage is None else f"{stage}: {reason}"


def _times(line: EventLine) -> str:
    """``37x over 71.1 s, last 01:14:52Z``: how many, over how long, and when the last one came,
    in UTC as the API's times (the date too where it is not the first's day); the line's detail
    is the last one's: without its time a reader took it for the first's."""
    if line.count == 1:
        return ""
    first, last = _instant(line.at), _instant(line.last_at or line.at)
    span_s = (last - first).total_seconds()
    clock = f"{last:%H:%M:%S}Z" if last.date() == first.date() else f"{last:%Y-%m-%d %H:%M:%S}Z"
    return f"{line.count}x over {_span(span_s)}, last {clock}"


def _span(seconds: float) -> str:
    """A span as a person reads it: ``11.9 s``, ``420 s``, ``17.5 min``, ``3.2 h`` (``.3g``
    wrote 1,050 s as ``1.05e+03 s``)."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 600:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def events(args: argparse.Namespace) -> int:
    kinds = _kind_list(args.kind, "--kind")
    excluded = _kind_list(args.exclude_kind, "--exclude-kind")
    decision_kinds = None if kinds is None else [k for k in kinds if k != INSTANCE_KIND]
    decision_excluded = None if excluded is None else [k for k in excluded if k != INSTANCE_KIND]
    want_decisions = decision_kinds is None or bool(decision_kinds)
    want_instances = (kinds is None or INSTANCE_KIND in kinds) and INSTANCE_KIND not in (
        excluded or ()
    )
    decisions: list[dict[str, Any]] = []
    instance_events: list[dict[str, Any]] = []
    with client_from(args) as client:
        if want_decisions:
            decisions = client.get(
                app_path(args.app, "decisions"),
                since=args.since,
                limit=args.limit,
                kind=decision_kinds,
                exclude_kind=decision_excluded or None,
            )
        if want_instances:
            instance_events = client.get(
                app_path(args.app, "events"), since=args.since, limit=args.limit
            )
        # The kinds in the app's log, where the decision kinds asked for matched nothing.
        present: list[str] | None = None
        if decision_kinds and not decisions and not instance_events:
            # Decision kinds are an open set (nothing refuses a misspelt one): name the kinds
            # the app's log has, so that a typo reads as one; ``instance`` only where the log
            # holds an instance event (whatever --since), as the decisions' kinds.
            recent = client.get(app_path(args.app, "decisions"), limit=1000)
            moved = client.get(app_path(args.app, "events"), limit=1)
            present = sorted({d["kind"] for d in recent} | ({INSTANCE_KIND} if moved else set()))
    staged = len({_stage(d) for d in decisions} - {None}) > 1
    merged = sorted(
        [
            EventLine(d["at"], "decision", d["kind"], _decision_detail(d, staged),
                      d.get("count") or 1, d.get("last_at"), _subject(d))
            for d in decisions
        ]
        + [
            EventLine(
                e["at"],
                "instance",
                f"{e['from_state'] or 'new'} -> {e['to_state']}",
                f"{e['instance_id']}: {e['reason']}",
            )
            for e in instance_events
        ],
        key=lambda line: (_instant(line.at), line.what, line.kind, line.detail),
    )  # fmt: skip

    def human() -> str:
        if not merged and present is not None:
            wanted = f"no events of kind {', '.join(kinds or ())}"
            if not present:
                return f"{wanted}; {args.app}'s log is empty"
            if any(k not in present for k in kinds or ()):
                return f"{wanted}; the kinds in {args.app}'s log: {', '.join(present)}"
            # Every kind asked for is in the log: what left none is the other options.
            why = []
            if args.since:
                why.append(f"since {args.since}")
            if set(kinds or ()) <= set(excluded or ()):
                why.append("--exclude-kind excludes them")
            return f"{wanted}" + (f" ({'; '.join(why)})" if why else "")
        if not merged:
            return "no events"
        if args.no_collapse:
            # A decision the service merged (a repeated one) is still one record: its count,
            # span and last time say whose detail it shows.
            rows = [[x.at, x.what, x.kind, _times(x), x.detail] for x in merged]
            return table(["AT", "WHAT", "KIND", "TIMES", "DETAIL"], rows)
        rows = [[x.at, x.what, x.kind, _times(x), x.detail] for x in collapse(merged)]
        return table(["AT", "WHAT", "KIND", "TIMES", "DETAIL"], rows)

    return emit(
        args.json, {"app": args.app, "decisions": decisions, "events": instance_events}, human
    )
