"""``benchmarks/serving_speed/layers.py`` runs end to end at tiny sizes and reports every figure
(how fast each layer is, the benchmark's business, is not checked here)."""

from __future__ import annotations

import math

import pytest

from benchmarks.serving_speed import layers as api_layers


def test_measure_reports_every_figure_as_a_finite_median_and_spread() -> None:
    result = api_layers.measure(requests=20, repeats=2)
    assert set(result) == {*api_layers.FIGURES, "loadavg_before", "loadavg_after"}
    for name in api_layers.FIGURES:
        figure = result[name]
        assert set(figure) == {"median", "min", "max"}, name
        assert all(math.isfinite(v) for v in figure.values()), (name, figure)
        assert figure["min"] <= figure["median"] <= figure["max"], (name, figure)
        if name != "fast_path_saves_us":  # a difference of two figures
            assert figure["min"] > 0.0, (name, figure)
    assert len(result["loadavg_before"]) == len(result["loadavg_after"]) == 3


def test_bad_arguments_are_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        api_layers.main(["--requests", "0"])
    assert stopped.value.code == 2
    assert "--requests and --repeats must be >= 1" in capsys.readouterr().err
