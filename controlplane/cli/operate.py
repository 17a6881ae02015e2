"""The operator's commands against a running service (REST API, docs/api.md):

- ``heteroplane app apply -f spec.yaml`` (register, or replace the spec of an app that exists),
  ``app list``, ``app get NAME``, ``app delete NAME [--force]``;
- ``heteroplane plans preview --app APP --rate-qps R`` (or a gamma trace), ``plans list``,
  ``plans apply --app APP --id ID``: named ``plans`` because ``heteroplane plan`` is the offline
  planner on a spec file and a trace file;
- ``heteroplane budget get --app APP``, ``budget set --app APP --usd-per-hr X --reason R``;
- ``heteroplane fleet [--app APP]``;
- ``heteroplane events --app APP`` (decisions and instance events, in time order).

Each prints a table or a summary, or with ``--json`` the server's JSON as one object. The
transport and the shared options are :mod:`controlplane.cli.client`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from controlplane.cli.client import (
    ApiClientError,
    add_client_options,
    app_path,
    client_from,
    table,
)
from controlplane.cli.output import emit
from controlplane.spec import load_spec

__all__ = ["register"]


def register(subparsers: Any) -> None:
    _register_app(subparsers)
    _register_plans(subparsers)
    _register_budget(subparsers)
    _register_fleet(subparsers)
    _register_events(subparsers)


def _actions(subparsers: Any, name: str, help_text: str, dest: str) -> Any:
    parser = subparsers.add_parser(name, help=help_text, description=help_text)
    actions = parser.add_subparsers(dest=dest, metavar="ACTION")
    actions.required = True
    return actions


def _app_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--app", required=True, metavar="APP", help="the app's name")


# --- app -------------------------------------------------------------------------------------


def _register_app(subparsers: Any) -> None:
    actions = _actions(subparsers, "app", "register and manage apps on the service", "app_command")
    apply = actions.add_parser(
        "apply",
        help="register an app from its spec file, or replace the spec of the app of that name",
        description="Read the spec (relative paths resolve against its folder and are sent"
        " absolute, so the service must see the same files), then create the app, or replace its"
        " spec when it exists (a budget change in it is audited).",
    )
    apply.add_argument("-f", "--file", required=True, type=Path, metavar="FILE", help="spec YAML")
    apply.set_defaults(handler=_app_apply)
    listing = actions.add_parser("list", help="list the apps")
    listing.set_defaults(handler=_app_list)
    get = actions.add_parser("get", help="show an app")
    get.add_argument("name", metavar="NAME")
    get.set_defaults(handler=_app_get)
    delete = actions.add_parser("delete", help="delete an app and its history (admin token)")
    delete.add_argument("name", metavar="NAME")
    delete.add_argument(
        "--force", action="store_true", help="even with live instances (their rows only)"
    )
    delete.set_defaults(handler=_app_delete)
    for action in (apply, listing, get, delete):
        add_client_options(action)


def _app_line(app: dict[str, Any]) -> str:
    plan = app["applied_plan_id"]
    return (
        f"{app['name']}: budget ${app['budget_usd_per_hr']:g}/hr, version {app['version']},"
        f" {'plan ' + str(plan) + ' applied' if plan is not None else 'no plan applied'}"
    )


def _app_apply(args: argparse.Namespace) -> int:
    spec = load_spec(args.file)
    document = spec.model_dump(mode="json", exclude_none=True)
    client = client_from(args)
    try:
        app = client.get(app_path(spec.name))
    except ApiClientError as error:
        if error.status != 404:
            raise
        app = None
    if app is None:
        app, verb = client.post("/v1/apps", document), "registered"
    elif app["spec"] != document:
        app, verb = client.put(app_path(spec.name), document), "updated"
    else:
        # Replacing a spec by itself would still bump the app's version and stale its plans.
        verb = "unchanged:"
    return emit(args.json, app, lambda: f"{verb} {_app_line(app)}")


def _app_list(args: argparse.Namespace) -> int:
    apps = client_from(args).get("/v1/apps")
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


def _app_get(args: argparse.Namespace) -> int:
    app = client_from(args).get(app_path(args.name))
    return emit(args.json, app, lambda: _app_line(app))


def _app_delete(args: argparse.Namespace) -> int:
    client_from(args).delete(app_path(args.name), force="true" if args.force else None)
    return emit(
        args.json, {"deleted": args.name}, lambda: f"deleted app {args.name} and its history"
    )


# --- plans -----------------------------------------------------------------------------------


def _register_plans(subparsers: Any) -> None:
    actions = _actions(
        subparsers,
        "plans",
        "preview and apply plans on the service (the offline planner is `heteroplane plan`)",
        "plans_command",
    )
    preview = actions.add_parser(
        "preview",
        help="plan the app on a synthetic trace and store the plan (nothing changes yet)",
        description="Ask the service for a plan on a Poisson trace at --rate-qps (or a gamma"
        " trace with --cv2); the plan is stored, and applied with `plans apply`.",
    )
    _app_option(preview)
    preview.add_argument(
        "--rate-qps", required=True, type=float, metavar="R", help="arrival rate to plan for"
    )
    preview.add_argument(
        "--cv2", type=float, metavar="X", help="gamma gaps with this CV^2 (default: Poisson)"
    )
    preview.add_argument("--duration", type=float, metavar="S", help="trace length in seconds")
    preview.add_argument(
        "--batch-dist", metavar="SPEC", help="batch sizes: fixed:N, kairos, lognormal:..., ..."
    )
    preview.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    preview.set_defaults(handler=_plans_preview)
    listing = actions.add_parser("list", help="list the app's plans")
    _app_option(listing)
    listing.set_defaults(handler=_plans_list)
    apply = actions.add_parser("apply", help="apply a previewed plan")
    _app_option(apply)
    apply.add_argument("--id", required=True, type=int, metavar="ID", help="the plan's id")
    apply.set_defaults(handler=_plans_apply)
    for action in (preview, listing, apply):
        add_client_options(action)


def _plan_text(plan: dict[str, Any]) -> str:
    verdict = (
        f"feasible at ${plan['cost_usd_per_hr']:.3f}/hr"
        if plan["feasible"]
        else f"NOT feasible: at most {plan.get('max_feasible_qps') or 0:.2f} qps can be served"
    )
    lines = [f"plan {plan['id']} of {plan['app']} ({plan['status']}): {verdict}"]
    trace = plan.get("trace")
    if trace:
        lines.append(f"  trace: {trace['count']:,} queries, {trace['source']}")
    for s in plan["stages"]:
        fleet = ", ".join(f"{n} x {t}" for t, n in s["fleet"].items())
        lines.append(
            f"  {s['name']}: {fleet}, batch {s['batch_size']}, {s['policy']} dispatch;"
            f" P99 {s['predicted_p99_ms']:.1f} ms, {s['throughput_qps']:.2f} qps,"
            f" ${s['cost_usd_per_hr']:.3f}/hr"
        )
    lines += [f"  - {step}" for step in plan["steps"]]
    return "\n".join(lines)


def _plans_preview(args: argparse.Namespace) -> int:
    trace: dict[str, Any] = {"rate_qps": args.rate_qps, "seed": args.seed}
    if args.cv2 is not None:
        trace |= {"kind": "gamma", "cv2": args.cv2}
    if args.duration is not None:
        trace["duration_s"] = args.duration
    if args.batch_dist is not None:
        trace["batch_dist"] = args.batch_dist
    plan = client_from(args).post(app_path(args.app, "plans"), {"trace": trace, "seed": args.seed})
    return emit(
        args.json,
        plan,
        lambda: (
            _plan_text(plan)
            + f"\napply it with: heteroplane plans apply --app {args.app} --id {plan['id']}"
        ),
    )


def _plans_list(args: argparse.Namespace) -> int:
    plans = client_from(args).get(app_path(args.app, "plans"))
    rows = [
        [
            p["id"],
            p["number"],
            p["status"],
            "yes" if p["feasible"] else "no",
            p["cost_usd_per_hr"],
            p["planned_rate_qps"],
            p["created_at"],
        ]
        for p in plans
    ]
    headers = ["ID", "NUMBER", "STATUS", "FEASIBLE", "COST_USD_PER_HR", "RATE_QPS", "CREATED"]
    return emit(
        args.json,
        {"plans": plans},
        lambda: table(headers, rows) if rows else f"no plans for {args.app}",
    )


def _plans_apply(args: argparse.Namespace) -> int:
    plan = client_from(args).post(app_path(args.app, "plans", str(args.id), "apply"))
    return emit(args.json, plan, lambda: _plan_text(plan))


# --- budget ----------------------------------------------------------------------------------


def _register_budget(subparsers: Any) -> None:
    actions = _actions(
        subparsers, "budget", "read or change an app's budget (audited)", "budget_command"
    )
    get = actions.add_parser("get", help="the budget, the fleet's cost and the audit trail")
    _app_option(get)
    get.set_defaults(handler=_budget_get)
    put = actions.add_parser(
        "set", help="change the budget; lists the instances to drain if it is below the fleet"
    )
    _app_option(put)
    put.add_argument("--usd-per-hr", required=True, type=float, metavar="X", help="new budget")
    put.add_argument("--reason", required=True, metavar="TEXT", help="why (kept in the audit)")
    put.set_defaults(handler=_budget_set)
    for action in (get, put):
        add_client_options(action)


def _budget_get(args: argparse.Namespace) -> int:
    budget = client_from(args).get(app_path(args.app, "budget"))

    def human() -> str:
        head = (
            f"{budget['app']}: budget ${budget['budget_usd_per_hr']:g}/hr, fleet costs"
            f" ${budget['fleet_cost_usd_per_hr']:.3f}/hr"
        )
        rows = [
            [c["at"], c["who"], c["old_usd_per_hr"], c["new_usd_per_hr"], c["reason"]]
            for c in budget["changes"]
        ]
        return head + "\n" + table(["AT", "WHO", "OLD", "NEW", "REASON"], rows)

    return emit(args.json, budget, human)


def _budget_set(args: argparse.Namespace) -> int:
    answer = client_from(args).put(
        app_path(args.app, "budget"),
        {"budget_usd_per_hr": args.usd_per_hr, "reason": args.reason},
    )

    def human() -> str:
        previous = answer["previous_usd_per_hr"]
        lines = [
            f"{answer['app']}: budget ${answer['budget_usd_per_hr']:g}/hr"
            + (f" (was ${previous:g}/hr)" if previous is not None else "")
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


def _register_fleet(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "fleet",
        help="the instances the service runs (of one app: its fleet by type and cost)",
        description="List the instances the service runs; with --app, the app's live fleet by"
        " instance type and what it costs, then its instances.",
    )
    parser.add_argument("--app", metavar="APP", help="only this app")
    add_client_options(parser)
    parser.set_defaults(handler=_fleet)


def _fleet(args: argparse.Namespace) -> int:
    client = client_from(args)
    summary = client.get(app_path(args.app, "fleet")) if args.app else None
    instances = client.get("/v1/instances", app=args.app)

    def human() -> str:
        lines = []
        if summary is not None:
            lines.append(
                f"{summary['app']}: {summary['instances']} live instance(s),"
                f" ${summary['cost_usd_per_hr']:.3f}/hr of a ${summary['budget_usd_per_hr']:g}/hr"
                " budget"
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
        lines.append(
            table(["ID", "APP", "PROVIDER_ID", "TYPE", "STATE"], rows) if rows else "no instances"
        )
        return "\n".join(lines)

    data: dict[str, Any] = {"instances": instances}
    if summary is not None:
        data["fleet"] = summary
    return emit(args.json, data, human)


def _register_events(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "events",
        help="what happened to an app: decisions and instance events, in time order",
    )
    _app_option(parser)
    parser.add_argument("--since", metavar="TIME", help="only after this ISO 8601 time")
    parser.add_argument(
        "--limit", type=int, default=100, metavar="N", help="the newest N of each (default 100)"
    )
    add_client_options(parser)
    parser.set_defaults(handler=_events)


def _events(args: argparse.Namespace) -> int:
    client = client_from(args)
    decisions = client.get(app_path(args.app, "decisions"), since=args.since, limit=args.limit)
    events = client.get(app_path(args.app, "events"), since=args.since, limit=args.limit)
    merged = sorted(
        [(d["at"], "decision", d["kind"], d["reason"]) for d in decisions]
        + [
            (
                e["at"],
                "instance",
                f"{e['from_state'] or 'new'} -> {e['to_state']}",
                f"{e['instance_id']}: {e['reason']}",
            )
            for e in events
        ]
    )
    return emit(
        args.json,
        {"app": args.app, "decisions": decisions, "events": events},
        lambda: table(["AT", "WHAT", "KIND", "DETAIL"], merged) if merged else "no events",
    )
