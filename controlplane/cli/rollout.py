"""``heteroplane rollout start|status|pause|resume|abort``: a new model version into a running
app, step by step (docs/rollouts.md), through the REST API (``/v1/apps/{app}/rollouts``)."""

from __future__ import annotations

import argparse
from typing import Any

from controlplane.cli.client import ApiClient, app_path, client_from
from controlplane.cli.output import UsageError, emit

# A rollout that still moves (controlplane.policies.rollout.ACTIVE_STATES, not imported: the
# command line starts without the estimator).
_ACTIVE_STATES = ("pending", "running", "paused")

__all__ = ["rollout_action", "rollout_start", "rollout_status"]


def _line(r: dict[str, Any]) -> str:
    shares = ", ".join(f"{100 * s:g}%" for s in r["steps"])
    cascade = r.get("cascade")
    state = r["state"] + (f" ({r['phase'].replace('_', ' ')})" if r.get("phase") else "")
    line = (
        f"rollout {r['id']} of {r['app']}: {r['model']} {r['artifact']}@{r['from_version']} ->"
        f" @{r['to_version']}, {state}, {100 * r['step_share']:g}% of queries on the new"
        f" version (steps {shares}{'; shadow step' if r.get('shadow_step') else ''}): {r['reason']}"
    )
    if cascade:
        before = cascade.get("held_out_accuracy_before")
        line += (
            f"\n  cascade thresholds {cascade['thresholds']} (were {cascade['thresholds_before']}):"
            f" held-out accuracy {cascade['held_out_accuracy']:.4f}"
            + ("" if before is None else f" (was {before:.4f})")
        )
    figures = r.get("figures") or {}
    for version, f in sorted(figures.get("versions", {}).items()):
        p99 = "-" if f.get("p99_ms") is None else f"{f['p99_ms']:.1f} ms"
        agreement = f.get("agreement_share")
        accuracy = f.get("accuracy")
        line += (
            f"\n  {version}: {f.get('queries', 0)} queries, {f.get('errors', 0)} errors, P99 {p99}"
            + ("" if agreement is None else f", agreement {agreement:.3f}")
            + ("" if accuracy is None else f", accuracy {accuracy:.3f}")
        )
    return line


def rollout_start(args: argparse.Namespace) -> int:
    thresholds: dict[str, Any] = {}
    keys = ("max_p99_ms", "max_error_share", "min_agreement_share", "min_queries", "min_accuracy")
    for key in keys:
        value = getattr(args, key)
        if value is not None:
            thresholds[key] = value
    body: dict[str, Any] = {
        "model": args.model,
        "steps": [p / 100.0 for p in args.steps],
        "interval_s": args.interval_s,
        "shadow": args.shadow,
        "thresholds": thresholds,
    }
    with client_from(args) as client:
        if args.validation_data is not None:
            body["validation"] = _validation(client, args)
        answer = client.post(app_path(args.app, "rollouts"), body)
    # The start returns at once; the rollout loop profiles, starts the workers, moves traffic.
    follow = (
        f"\n  follow it: heteroplane rollout status --app {args.app}"
        f" (heteroplane events --app {args.app} --kind rollout: every move and why)"
    )
    return emit(args.json, answer, lambda: _line(answer) + follow)


def _validation(client: ApiClient, args: argparse.Namespace) -> dict[str, Any]:
    """The validation records of the app's models with the new version in its model's place,
    run here on ``--validation-data`` (as ``cascade evaluate --app`` runs them)."""
    from controlplane.cli.cascade_registered import load_data, registered_models, validation_records

    inputs, labels = load_data(args.validation_data, "--validation-data")
    spec = client.get(app_path(args.app))["spec"]
    name, _, version = args.model.partition("@")
    models = []
    for model, reference, how in registered_models(spec):
        if reference.partition("@")[0] == name:
            reference = f"{name}@{version}" if version else name
        models.append((model, reference, how))
    return validation_records(
        client, models, inputs, labels, args.validation_data.name, "--validation-data"
    )


def _latest(client: ApiClient, app: str) -> dict[str, Any]:
    found = client.get(app_path(app, "rollouts"))
    if not found:
        raise UsageError(f"app {app!r} has no rollout (heteroplane rollout start --app {app} ...)")
    active = [r for r in found if r["state"] in _ACTIVE_STATES]
    latest: dict[str, Any] = (active or found)[-1]
    return latest


def rollout_status(args: argparse.Namespace) -> int:
    with client_from(args) as client:
        if args.id is not None:
            answer = client.get(app_path(args.app, "rollouts", str(args.id)))
        else:
            answer = _latest(client, args.app)
    return emit(args.json, answer, lambda: _line(answer))


def rollout_action(args: argparse.Namespace) -> int:
    """pause, resume or abort the app's active rollout."""
    with client_from(args) as client:
        current = _latest(client, args.app)
        if current["state"] not in _ACTIVE_STATES:
            raise UsageError(
                f"app {args.app!r} has no rollout in progress (the latest, {current['id']}, is"
                f" {current['state']})"
            )
        answer = client.post(
            app_path(args.app, "rollouts", str(current["id"]), args.rollout_command)
        )
    return emit(args.json, answer, lambda: _line(answer))
