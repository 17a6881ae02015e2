"""Bad options and files on the command line: one line on stderr and exit status 2, never a
traceback (a negative --seed, absurd counts and bounds, a planning trace of one arrival, an
empty app name, a --url that is not one)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from controlplane.cli import main
from tests.component.test_api import write_profiles
from tests.unit.test_cli_simulate import write_profile_csv
from tests.unit.test_cli_trace import one_line_error
from tests.unit.test_gears import PLACEMENT
from tests.unit.test_gears import _app as gears_app


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _simulate(tmp_path: Path, *extra: str) -> list[str]:
    profiles = write_profile_csv(tmp_path / "p.csv")
    return [
        "simulate",
        "--profiles",
        str(profiles),
        "--model",
        "m",
        "--fleet",
        "g4dn.xlarge=1,r5n.large=2",
        "--qps",
        "20",
        "--duration",
        "10",
        "--qos-ms",
        "50",
        *extra,
    ]


def _capacity(tmp_path: Path, *extra: str) -> list[str]:
    profiles = write_profile_csv(tmp_path / "p.csv")
    return [
        "capacity",
        "--profiles",
        str(profiles),
        "--model",
        "m",
        "--fleet",
        "g4dn.xlarge=1,r5n.large=2",
        "--qos-ms",
        "50",
        "--batch-dist",
        "fixed:1",
        "--queries",
        "200",
        *extra,
    ]


def _bounds(tmp_path: Path, *extra: str) -> list[str]:
    profiles = write_profile_csv(tmp_path / "p.csv")
    return [
        "bounds",
        "--profiles",
        str(profiles),
        "--model",
        "m",
        "--qos-ms",
        "50",
        "--batch-dist",
        "fixed:1",
        "--budget",
        "2",
        *extra,
    ]


def _app_files(tmp_path: Path) -> tuple[Path, Path]:
    """A spec of one model on the API tests' sub-linear profiles and a 60 s Poisson trace."""
    write_profiles(tmp_path)
    spec = _write(
        tmp_path / "app.yaml",
        "name: toy\nmodels:\n  - {name: m, profiles: profiles.csv}\nslo: {latency_ms: 40}\n"
        "budget_usd_per_hr: 4\ninstance_types: [g4dn.xlarge, r5n.large, t3.xlarge]\n",
    )
    arrival = np.cumsum(np.random.default_rng(0).exponential(1 / 20, size=1200))
    trace = _write(
        tmp_path / "t.csv",
        "arrival_s,batch_size\n" + "".join(f"{a!r},1\n" for a in arrival.tolist()),
    )
    return spec, trace


# --- --seed ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command", ["simulate", "capacity", "bounds", "bounds+", "plan", "replay", "demo"]
)
def test_a_negative_seed_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    spec, trace = _app_files(tmp_path)
    argv = {
        "simulate": _simulate(tmp_path),
        "capacity": _capacity(tmp_path),
        "bounds": _bounds(tmp_path),
        "bounds+": _bounds(tmp_path, "--kairos-plus", "--queries", "200"),
        "plan": ["plan", "--spec", str(spec), "--trace", str(trace)],
        "replay": ["replay", "--spec", str(spec), "--trace", str(trace), "--policy", "peak"],
        "demo": ["demo", "--offline"],
    }[command]
    error = one_line_error(capsys, [*argv, "--seed", "-1"])
    assert error.endswith("--seed must be >= 0, got -1")


def test_a_negative_seed_on_gears_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec, validation = gears_app(tmp_path)
    argv = ["gears", "--spec", str(spec), "--validation", str(validation)]
    argv += ["--placement", PLACEMENT, "--seed", "-1"]
    assert one_line_error(capsys, argv).endswith("--seed must be >= 0, got -1")


# --- simulate and capacity ---------------------------------------------------------------------


def test_an_absurd_max_batch_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = _simulate(tmp_path, "--max-batch", "99999999999999999999")
    assert "--max-batch must be at most 1,000,000" in one_line_error(capsys, argv)


@pytest.mark.parametrize("threshold", ["-1", "99999999999999999999"])
@pytest.mark.parametrize("command", ["simulate", "capacity"])
def test_a_drs_threshold_out_of_range_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, threshold: str
) -> None:
    make = _simulate if command == "simulate" else _capacity
    argv = make(tmp_path, "--policy", "drs", "--drs-threshold", threshold)
    assert "--drs-threshold must be in 0..1,000,000" in one_line_error(capsys, argv)


def test_a_drs_threshold_in_range_still_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_simulate(tmp_path, "--policy", "drs", "--drs-threshold", "0", "--json")) == 0
    assert json.loads(capsys.readouterr().out)["policy"] == "drs"


@pytest.mark.parametrize("command", ["capacity", "bounds"])
def test_too_many_probe_queries_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    argv = (
        _capacity(tmp_path, "--queries", "999999999999")
        if command == "capacity"
        else _bounds(tmp_path, "--kairos-plus", "--queries", "999999999999")
    )
    assert "--queries must be at most 1,000,000, got 999999999999" in one_line_error(capsys, argv)


# --- bounds ------------------------------------------------------------------------------------


def test_an_absurd_budget_is_not_an_overflow(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = _bounds(tmp_path, "--max-count", "g4dn.xlarge=2,r5n.large=3", "--json")
    argv[argv.index("--budget") + 1] = "1e308"
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ranking"] and "Traceback" not in capsys.readouterr().err


# --- replay ------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", ["0,1\n", "0,1\n0,1\n"])
def test_a_planning_trace_without_a_rate_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], rows: str
) -> None:
    spec, trace = _app_files(tmp_path)
    assert main(["plan", "--spec", str(spec), "--trace", str(trace), "--json"]) == 0
    plan = _write(tmp_path / "p.json", capsys.readouterr().out)
    planning = _write(tmp_path / "one_row.csv", "arrival_s,batch_size\n" + rows)
    argv = ["replay", "--spec", str(spec), "--plan", str(plan), "--policy", "tuner"]
    argv += ["--planning-trace", str(planning)]
    error = one_line_error(capsys, [*argv, "--trace", str(trace)])
    assert f"--planning-trace {planning}: a planning trace needs at least two arrivals" in error
    # The default planning trace (the replayed trace's first 10%) of a one-row trace too.
    error = one_line_error(capsys, [*argv[:-2], "--trace", str(planning)])
    assert "(the default --planning-trace): a planning trace needs at least two" in error


@pytest.mark.parametrize(
    ("rows", "why"),
    [
        ("0,10\n0,10\n0,10\n", "a plan needs at least two arrivals at different times"),
        ("0,10\n1e-300,10\n2e-300,10\n", "is past what heteroplane plans for (100,000 qps)"),
    ],
)
def test_plan_refuses_a_trace_without_a_plannable_rate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], rows: str, why: str
) -> None:
    spec, _ = _app_files(tmp_path)
    trace = _write(tmp_path / "bad.csv", "arrival_s,batch_size\n" + rows)
    error = one_line_error(capsys, ["plan", "--spec", str(spec), "--trace", str(trace)])
    assert error.startswith(f"heteroplane plan: --trace {trace}: ") and why in error


# --- trace and profile files -------------------------------------------------------------------


def test_trace_stats_of_huge_arrival_times(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path / "t.csv", "arrival_s\n0\n1e200\n2e200\n")
    assert main(["trace", "stats", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["count"] == 3 and out["cv2"] == 0.0 and out["duration_s"] == 2e200
    # In words, four significant digits, not two hundred: and a rate that is not 0 not as 0.000.
    assert main(["trace", "stats", str(path)]) == 0
    assert capsys.readouterr().out.strip() == (
        f"{path}: 3 queries over 2e+200 s: 1e-200 qps, CV^2 of gaps 0.000, batch size mean 1.00"
        " max 1"
    )


def test_trace_generate_over_a_huge_duration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "x.csv"
    argv = ["trace", "generate", "--kind", "poisson", "--rate", "1e-160", "--duration", "1e163"]
    assert main([*argv, "--out", str(out), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["count"] > 100 and 0.5 < stats["cv2"] < 2.0


def test_trace_generate_into_a_missing_folder_names_the_path_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "missing" / "x.csv"
    argv = ["trace", "generate", "--kind", "poisson", "--rate", "1", "--duration", "10"]
    error = one_line_error(capsys, [*argv, "--out", str(out)])
    assert error == f"heteroplane trace: cannot read or write {out}: No such file or directory"
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize("command", ["profile", "simulate"])
def test_a_profile_batch_size_of_ten_to_the_thirty_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    path = _write(
        tmp_path / "huge.json",
        json.dumps(
            {
                "format": "heteroplane.profiles/v1",
                "profiles": [
                    {
                        "model": "m",
                        "instance_type": "g4dn.xlarge",
                        "batch_sizes": [1, 10**30],
                        "latency_ms": [[1.0, 2.0], [3.0, 4.0]],
                    }
                ],
            }
        ),
    )
    simulate = ["simulate", "--profiles", str(path), "--model", "m", "--fleet", "g4dn.xlarge=1"]
    argv = (
        ["profile", "show", str(path)]
        if command == "profile"
        else [*simulate, "--qps", "1", "--duration", "10", "--qos-ms", "100"]
    )
    error = one_line_error(capsys, argv)
    assert "profiles[0]: batch_sizes must be at most 1,000,000, got 10000000000" in error


_DEEP = "[" * 100_000 + "]" * 100_000
_KAIROS_HEADER = "model,instance_type,batch_size,sample,infer_ms,load_ms\n"


@pytest.mark.parametrize(
    ("name", "text", "command", "expected"),
    [
        # JSON nested past the parser's recursion limit, wherever a JSON file is read.
        ("deep.json", _DEEP, "spec", "deep.json: JSON nested too deeply to read"),
        ("deep.yaml", _DEEP, "spec", "deep.yaml: YAML nested too deeply to read"),
        ("deep.json", _DEEP, "plan", "deep.json: JSON nested too deeply to read"),
        ("deep.json", _DEEP, "catalog", "deep.json: JSON nested too deeply to read"),
        ("p.json", '{"profiles": ' + _DEEP + "}", "profiles", "JSON nested too deeply to read"),
        # A cell past the csv module's field size limit.
        ("t.csv", "arrival_s,batch_size\n0,1\n1," + "1" * 200_000, "trace", "not a readable CSV"),
        ("p.csv", _KAIROS_HEADER + "m,c5.xlarge,1,0,10," + "1" * 200_000, "profiles",
         "not a readable CSV"),
        # Integers past any float or 64 bits.
        ("c.json", '[{"instance_type": "x1", "price_usd_per_hr": 1' + "0" * 400 + "}]",
         "catalog", "price_usd_per_hr: must be finite, got a number too large"),
        ("p.json", '{"profiles": [{"model": "m", "instance_type": "c5.xlarge", "batch_sizes": [1],'
         ' "latency_ms": [[1' + "0" * 400 + "]]}]}", "profiles",
         "latency_ms holds a number too large"),
        # A Kairos CSV's batch size is a whole number: 2.7 is not read as 2.
        ("p.csv", _KAIROS_HEADER + "m,c5.xlarge,2.7,0,10,1\nm,c5.xlarge,2,1,12,1\n", "profiles",
         "line 2: batch_size 2.7 is not a whole number"),
        ("p.csv", _KAIROS_HEADER + "m,c5.xlarge,1e30,0,10,1\n", "profiles",
         "line 2: batch_size 1e+30 is past the largest"),
        # Values past any measurement or price: the costs and rates computed from them overflowed
        # (an infinite cost, a --json traceback, a 300-digit error message).
        ("c.csv", "instance_type,price_usd_per_hr\ng4dn.xlarge,1e308\n", "catalog",
         "price_usd_per_hr: must be at most 1,000,000 USD/hr, got 1e+308"),
        ("p.json", '{"profiles": [{"model": "m", "instance_type": "c5.xlarge", "batch_sizes": [1],'
         ' "latency_ms": [[1e308]]}]}', "profiles", "must be at most 86,400,000 ms (a day)"),
        # A misspelt optional catalog column was ignored with the notes, its values lost.
        ("c.csv", "instance_type,price_usd_per_hr,spot_price_usd_hr\ng4dn.xlarge,0.5,0.2\n",
         "catalog", "column 'spot_price_usd_hr' is not one of the catalog's; did you mean"
         " 'spot_price_usd_per_hr'?"),
        # A key given twice in one JSON object: the last one was kept without a word.
        ("c.json", '[{"instance_type": "g4dn.xlarge", "price_usd_per_hr": 0.5,'
         ' "price_usd_per_hr": 5}]', "catalog", "key 'price_usd_per_hr' appears twice"),
        ("p.json", '{"profiles": [{"model": "m", "model": "n", "instance_type": "c5.xlarge",'
         ' "batch_sizes": [1], "latency_ms": [1]}]}', "profiles", "key 'model' appears twice"),
        ("s.json", '{"name": "a", "name": "b"}', "spec", "key 'name' appears twice"),
        # A profile entry's names and cells as the format has them, not whatever str() made.
        ("p.json", '{"profiles": [{"model": null, "instance_type": "c5.xlarge",'
         ' "batch_sizes": [1], "latency_ms": [1]}]}', "profiles",
         "model must be a non-empty name, got None"),
        ("p.json", '{"profiles": [{"model": "m", "instance_type": {"a": 1},'
         ' "batch_sizes": [1], "latency_ms": [1]}]}', "profiles",
         "instance_type must be a non-empty name, got {'a': 1}"),
        ("p.json", '{"profiles": [{"model": "m", "instance_type": "c5.xlarge",'
         ' "batch_sizes": [1, 2], "latency_ms": [[[1]], [2]]}]}', "profiles",
         "latency_ms must hold a number or a list of numbers per batch size"),
        ("p.json", '{"profiles": [{"model": "m", "instance_type": "c5.xlarge",'
         ' "batch_sizes": [1], "latency_ms": [1], "colour": "red"}]}', "profiles",
         "unknown field 'colour'"),
        # A trace's batch size past the largest, as simulate already refused it.
        ("t.csv", "arrival_s,batch_size\n0,2000000\n", "trace",
         "batch_size must be at most 1,000,000, got 2000000 at row 1"),
    ],
)  # fmt: skip
def test_files_past_the_parsers_limits_are_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    text: str,
    command: str,
    expected: str,
) -> None:
    (tmp_path / "bad").mkdir()
    bad = _write(tmp_path / "bad" / name, text)
    profiles = write_profile_csv(tmp_path / "ok.csv")
    trace = _write(tmp_path / "ok-trace.csv", "arrival_s,batch_size\n0,1\n1,1\n")
    argv = {
        "spec": ["plan", "--spec", str(bad), "--trace", str(trace)],
        "plan": ["replay", "--spec", str(bad), "--plan", str(bad), "--trace", str(trace)],
        "catalog": [*_simulate(tmp_path), "--catalog", str(bad)],
        "profiles": ["profile", "show", str(bad)],
        "trace": ["trace", "stats", str(bad)],
    }[command]
    if command == "plan":
        spec = _write(
            tmp_path / "app.yaml",
            f"name: a\nmodels: [{{name: m, profiles: {profiles}}}]\nslo: {{latency_ms: 100}}\n"
            "budget_usd_per_hr: 5\ninstance_types: [g4dn.xlarge]\n",
        )
        argv[2] = str(spec)
    error = one_line_error(capsys, argv)
    assert expected in error, error


def test_a_profile_csv_may_end_in_blank_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path / "p.csv", _KAIROS_HEADER + "m,c5.xlarge,1,0,10,1\n\n\n")
    assert main(["profile", "show", str(path), "--json"]) == 0
    assert "c5.xlarge" in capsys.readouterr().out


def test_options_that_would_be_ignored_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An option that does nothing where it is given is a one-line error, not silently dropped."""
    for policy in ("kairos", "clockwork"):
        error = one_line_error(capsys, _simulate(tmp_path, "--policy", policy, "--max-batch", "4"))
        assert f"the {policy} policy runs each query alone" in error
    drs = _simulate(tmp_path, "--policy", "drs", "--drs-threshold", "2", "--max-batch", "4")
    assert "the drs policy runs each query alone" in one_line_error(capsys, drs)
    spec = _write(
        tmp_path / "app.yaml",
        f"name: a\nmodels: [{{name: m, profiles: {tmp_path / 'p.csv'}}}]\n"
        "slo: {latency_ms: 100}\nbudget_usd_per_hr: 5\ninstance_types: [g4dn.xlarge]\n",
    )
    trace = _write(tmp_path / "t.csv", "arrival_s\n0\n1\n")
    plan = ["plan", "--spec", str(spec), "--trace", str(trace)]
    error = one_line_error(capsys, [*plan, "--thresholds", "0.5"])
    assert error.endswith("--thresholds: only with --pareto (the Pareto front of a cascade)")
    error = one_line_error(capsys, [*plan, "--validation", str(trace)])
    assert "--validation: only with --pareto" in error
    error = one_line_error(capsys, ["cascade", "evaluate", "--instance-type", "c5.xlarge"])
    assert "--instance-type goes with --profiles" in error
    error = one_line_error(capsys, _simulate(tmp_path, "--drs-threshold", "5"))
    assert error.endswith("--drs-threshold is drs's option; --policy is fcfs")
    error = one_line_error(capsys, _capacity(tmp_path, "--drs-threshold", "5"))
    assert error.startswith("heteroplane capacity: --drs-threshold is drs's option; --policy is")
    generate = ["trace", "generate", "--rate", "10", "--to-rate", "20", "--duration", "10"]
    generate += ["--out", str(tmp_path / "never.csv")]
    error = one_line_error(capsys, [*generate, "--kind", "step", "--at", "100"])
    assert error.endswith("--at 100 is not before the trace's end (--duration 10): the step would"
                          " never happen")  # fmt: skip
    assert not (tmp_path / "never.csv").exists()
    # The estimator demo runs no service: the service's options did nothing there.
    error = one_line_error(capsys, ["demo", "--offline", "--rate-qps", "5", "--no-load"])
    assert error.endswith("--rate-qps, --no-load: not with --offline (the estimator demo runs no"
                          " service)")  # fmt: skip
    error = one_line_error(capsys, ["demo", "--offline", "--port", "9"])
    assert "--port: not with --offline" in error


def _app_spec(tmp_path: Path, extra: str = "", slo: str = "{latency_ms: 100}") -> Path:
    """An app spec of one model ``m`` (write_profile_csv's) on g4dn.xlarge and r5n.large."""
    profiles = write_profile_csv(tmp_path / "p.csv")
    return _write(
        tmp_path / "app.yaml",
        f"name: a\nmodels: [{{name: m, profiles: {profiles}}}]\nslo: {slo}\n"
        f"budget_usd_per_hr: 5\ninstance_types: [g4dn.xlarge, r5n.large]\n{extra}",
    )


def test_max_counts_that_allow_no_instance_say_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = _app_spec(tmp_path, "max_counts: {g4dn.xlarge: 0, r5n.large: 0}\n")
    trace = _write(tmp_path / "t.csv", "arrival_s\n0\n1\n")
    error = one_line_error(capsys, ["plan", "--spec", str(spec), "--trace", str(trace)])
    assert "max_counts: allows no instance of any candidate type (g4dn.xlarge, r5n.large)" in error
    assert "outside the profile" not in error


def test_the_plan_summary_names_the_slos_percentile_on_every_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = _app_spec(tmp_path, slo="{latency_ms: 100, percentile: 50}")
    trace = _write(tmp_path / "t.csv", "arrival_s\n" + "\n".join(f"{i / 10}" for i in range(200)))
    assert main(["plan", "--spec", str(spec), "--trace", str(trace)]) == 0
    text = capsys.readouterr().out
    stage_lines = [line for line in text.splitlines() if line.startswith("  m: ")]
    assert stage_lines and all(" P50 " in line and "P99" not in line for line in stage_lines)


# --- the client commands -----------------------------------------------------------------------


def test_an_empty_app_name_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    error = one_line_error(
        capsys, ["app", "get", "", "--token", "t", "--url", "http://127.0.0.1:9"]
    )
    assert error == "heteroplane app: an app's name must not be empty"


@pytest.mark.parametrize(
    ("url", "why"),
    [("http://[::1", "Invalid IPv6 URL"), ("http://localhost:99999", "Port out of range")],
)
def test_a_url_that_does_not_parse_is_one_line_naming_the_option(
    capsys: pytest.CaptureFixture[str], url: str, why: str
) -> None:
    error = one_line_error(capsys, ["app", "list", "--url", url, "--token", "t"])
    assert error.startswith(f"heteroplane app: --url {url!r} is not a URL") and why in error


# --- gears -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--ranges", "100000000", "--ranges must be in 1..1,000, got 100000000"),
        ("--ranges", "0", "--ranges must be in 1..1,000, got 0"),
        ("--qps-max", "1e308", "--qps-max must be a number in (0, 1,000,000,000] qps, got 1e+308"),
        ("--qps-max", "inf", "--qps-max must be a number in (0, 1,000,000,000] qps, got inf"),
        ("--qps-max", "nan", "--qps-max must be a number in (0, 1,000,000,000] qps, got nan"),
    ],
)
def test_gears_refuses_absurd_ranges_and_spans(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, value: str, message: str
) -> None:
    spec, validation = gears_app(tmp_path)
    argv = ["gears", "--spec", str(spec), "--validation", str(validation)]
    argv += ["--placement", PLACEMENT, option, value]
    assert one_line_error(capsys, argv).endswith(message)


def test_gears_on_a_plan_of_another_app_names_its_stages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It said only "placement: places no model"."""
    from controlplane.policies.planner import plan_app
    from controlplane.spec import load_spec, resolve_spec
    from estimator.traces import read_trace_csv

    (tmp_path / "other").mkdir()
    other, trace = _app_files(tmp_path / "other")
    plan = plan_app(resolve_spec(load_spec(other)), read_trace_csv(trace))
    plan_path = _write(tmp_path / "plan.json", json.dumps(plan.to_document()))
    spec, validation = gears_app(tmp_path)
    argv = ["gears", "--spec", str(spec), "--validation", str(validation), "--plan", str(plan_path)]
    error = one_line_error(capsys, argv)
    assert "the plan's stage(s) 'm' are not models of the app" in error


def test_a_file_where_a_folder_is_wanted_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    junk = _write(tmp_path / "junk.csv", "a\n")
    error = one_line_error(capsys, ["profile", "measure", "--cache-dir", str(junk)])
    assert error.endswith("(a file where a folder is wanted)") and str(junk) in error


def test_json_output_writes_a_figure_that_is_not_finite_as_null(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """JSON has no infinity: ``--json`` of an overflowed figure was a ValueError's traceback."""
    from controlplane.cli.output import emit

    data = {"cost": float("inf"), "p99": [1.5, np.float64("nan")], "fleet": {"x": -np.inf}}
    assert emit(True, data, lambda: "") == 0
    assert json.loads(capsys.readouterr().out) == {
        "cost": None,
        "p99": [1.5, None],
        "fleet": {"x": None},
    }
