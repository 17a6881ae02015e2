"""``heteroplane trace``: generate a synthetic trace file, or summarise one.

``trace generate`` composes the estimator's generators (a rate profile, a renewal process, a
batch-size distribution) into a trace CSV; ``trace stats`` reads one back and prints its rate,
burstiness (CV^2) and batch sizes. Parsing and validation of the user's options happen here; the
math lives in ``estimator.traces`` and ``estimator.batches``.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import numpy as np

from controlplane.cli import output
from controlplane.cli.common import check_seed
from estimator.batches import parse_batch_distribution
from estimator.errors import WorkloadError
from estimator.traces import (
    RateProfile,
    Trace,
    TraceStats,
    constant_profile,
    diurnal_profile,
    read_trace_csv,
    renewal_arrivals,
    step_profile,
    trace_stats,
    with_spikes,
    write_trace_csv,
)


def _parse_spike(text: str, duration_s: float) -> tuple[float, float, float]:
    """A ``--spike``'s (start, length, factor), its length cut at the trace's end (a spike
    that outlasts it: the rate profile's pieces past it overflowed); one that starts at or
    after the end, or a number that is not finite, is refused naming the option."""
    parts = text.split(":")
    try:
        if len(parts) != 3:
            raise ValueError(text)
        start_s, length_s, factor = (float(part) for part in parts)
    except ValueError:
        raise output.UsageError(
            f"--spike {text!r}: expected START:LENGTH:FACTOR, e.g. 600:60:3"
        ) from None
    if not all(map(math.isfinite, (start_s, length_s, factor))):
        raise output.UsageError(f"--spike {text!r}: START, LENGTH and FACTOR must be finite")
    if math.isfinite(duration_s) and start_s >= duration_s:
        raise output.UsageError(
            f"--spike {text!r} does not start before the trace's end (--duration"
            f" {duration_s:g}): the spike would never happen"
        )
    if math.isfinite(duration_s) and length_s > 0:
        length_s = min(length_s, duration_s - start_s)
    return start_s, length_s, factor


def _refuse(args: argparse.Namespace, options: dict[str, str], kind: str) -> None:
    given = [flag for flag, attribute in options.items() if getattr(args, attribute) is not None]
    if given:
        raise output.UsageError(f"--kind {kind} does not take {', '.join(given)}")


def _require(args: argparse.Namespace, options: dict[str, str], kind: str) -> None:
    missing = [flag for flag, attribute in options.items() if getattr(args, attribute) is None]
    if missing:
        raise output.UsageError(f"--kind {kind} needs {', '.join(missing)}")


_STEP_OPTIONS = {"--to-rate": "to_rate", "--at": "at"}
_RAMP_OPTIONS = {"--over": "over"}
_DIURNAL_OPTIONS = {"--period": "period", "--amplitude": "amplitude"}


def _within(args: argparse.Namespace, kind: str) -> None:
    """A step or a ramp that starts at or after the trace's end never happens: the trace would
    be a constant rate under the name of a step."""
    if math.isfinite(args.at) and math.isfinite(args.duration) and args.at >= args.duration:
        raise output.UsageError(
            f"--at {args.at:g} is not before the trace's end (--duration {args.duration:g}):"
            f" the {kind} would never happen"
        )


def _profile(args: argparse.Namespace) -> tuple[RateProfile, float]:
    """The rate profile and the gaps' CV^2 the options describe (UsageError for bad combos)."""
    kind: str = args.kind
    if kind != "diurnal":
        _refuse(args, _DIURNAL_OPTIONS, kind)
    if kind not in ("step", "ramp"):
        _refuse(args, {**_STEP_OPTIONS, **_RAMP_OPTIONS}, kind)
    if kind == "poisson" and args.cv2 is not None and args.cv2 != 1.0:
        raise output.UsageError("--kind poisson has cv2 = 1; use --kind gamma for another --cv2")
    if kind == "gamma":
        _require(args, {"--cv2": "cv2"}, kind)
    cv2 = 1.0 if args.cv2 is None else float(args.cv2)

    if kind in ("poisson", "gamma"):
        profile = constant_profile(args.rate)
    elif kind == "step":
        _require(args, _STEP_OPTIONS, kind)
        _refuse(args, _RAMP_OPTIONS, kind)
        _within(args, kind)
        profile = step_profile(args.rate, args.to_rate, args.at)
    elif kind == "ramp":
        _require(args, {**_STEP_OPTIONS, **_RAMP_OPTIONS}, kind)
        if args.over <= 0.0:
            raise output.UsageError(f"--over must be > 0 for a ramp, got {args.over!r}")
        _within(args, kind)
        to_rate, over = args.to_rate, args.over
        end_s = args.at + over
        if math.isfinite(args.duration) and end_s > args.duration:
            # The ramp cut at the trace's end, the same rates within it (a ramp of 1e308 s
            # overflowed the profile's pieces past the end).
            over = args.duration - args.at
            to_rate = args.rate + (args.to_rate - args.rate) * over / args.over
        profile = step_profile(args.rate, to_rate, args.at, over)
    else:
        profile = diurnal_profile(
            args.rate,
            args.duration,
            period_s=86400.0 if args.period is None else args.period,
            amplitude=0.5 if args.amplitude is None else args.amplitude,
        )
    spikes = [_parse_spike(text, args.duration) for text in args.spike]
    # The highest rate the spikes could make (overlapping ones multiply; a diurnal rate reaches
    # twice its mean): past a float, refused here rather than overflowing in the profile.
    highest = 2.0 * max(args.rate, args.to_rate or 0.0) * math.prod(f for _, _, f in spikes)
    if not math.isfinite(highest):
        raise output.UsageError(
            "--spike: the rate its FACTOR makes is past any number; give a smaller FACTOR"
        )
    return with_spikes(profile, spikes), cv2


def _summary(stats: TraceStats) -> str:
    return (
        f"{stats.count} queries over {_fixed(stats.duration_s)} s: {_fixed(stats.rate_qps)} qps,"
        f" CV^2 of gaps {_fixed(stats.cv2)}, batch size mean {stats.mean_batch_size:.2f} "
        f"max {stats.max_batch_size}"
    )


def _fixed(value: float) -> str:
    """Three decimals, or four significant digits where those would print hundreds of digits
    (arrivals 1e300 s apart) or a rate that is not zero as 0.000."""
    if value != 0 and not 1e-3 <= abs(value) < 1e12:
        return f"{value:.4g}"
    return f"{value:.3f}"


def _stats_data(stats: TraceStats, path: str) -> dict[str, Any]:
    return {
        "count": stats.count,
        "duration_s": stats.duration_s,
        "rate_qps": stats.rate_qps,
        "cv2": stats.cv2,
        "mean_batch_size": stats.mean_batch_size,
        "max_batch_size": stats.max_batch_size,
        "path": path,
    }


def generate_trace(args: argparse.Namespace) -> int:
    """``trace generate``: build the workload, write the CSV, print its statistics."""
    profile, cv2 = _profile(args)
    batches = parse_batch_distribution(args.batch_dist)
    check_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    arrival_s = renewal_arrivals(profile, args.duration, cv2, rng)
    if arrival_s.size == 0:
        raise WorkloadError(
            f"no query arrived in {args.duration!r} s at these rates; raise --rate or --duration"
        )
    trace = Trace(arrival_s, batches.sample(arrival_s.size, rng))
    write_trace_csv(trace, args.out)
    stats = trace_stats(trace)
    path = str(Path(args.out))
    return output.emit(
        args.json, _stats_data(stats, path), lambda: f"wrote {path}: {_summary(stats)}"
    )


def show_stats(args: argparse.Namespace) -> int:
    """``trace stats``: read a trace CSV and print its statistics."""
    stats = trace_stats(read_trace_csv(args.file))
    return output.emit(
        args.json, _stats_data(stats, args.file), lambda: f"{args.file}: {_summary(stats)}"
    )
