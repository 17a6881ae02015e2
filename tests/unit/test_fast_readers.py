"""The fast readers give what the straightforward ones give: profiles from the Kairos CSV, bit for
bit and error for error, and arrival times from the piece-by-piece inversion of a rate profile."""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from estimator.errors import ProfileError
from estimator.profiles import (
    ProfileSet,
    _group_kairos_columns,
    _parse_kairos_csv,
    _read_kairos_columns,
    _read_kairos_columns_fast,
    load_profiles,
)
from estimator.traces import RateProfile, diurnal_profile, step_profile, with_spikes

HEADER = "model,instance_type,batch_size,sample,infer_ms,load_ms"

Dumped = list[tuple[tuple[str, str], list[int], list[bytes]]]


def dump(profiles: ProfileSet) -> Dumped:
    """Everything a profile set holds, in its order, with the samples' exact bits."""
    return [
        (key, profile.batch_sizes.tolist(), [cell.tobytes() for cell in profile.samples_ms])
        for key, profile in profiles.items()
    ]


def reference_profiles(text: str) -> Dumped:
    """The straightforward reading of a well-formed Kairos CSV: csv rows, latency = infer + load,
    grouped by (model, type, batch size), each cell sorted with its largest sample dropped,
    profiles in (model, type) order."""
    rows = csv.reader(io.StringIO(text))
    header = [name.strip() for name in next(rows)]
    cells: dict[tuple[str, str], dict[int, list[float]]] = {}
    for row in rows:
        if not row:
            continue  # a blank line (these files have them only at the end)
        field = dict(zip(header, row, strict=True))
        key = (field["model"], field["instance_type"])
        batch = int(float(field["batch_size"]))
        latency = float(field["infer_ms"]) + float(field["load_ms"])
        cells.setdefault(key, {}).setdefault(batch, []).append(latency)
    dumped: Dumped = []
    for key in sorted(cells):
        sizes = sorted(cells[key])
        samples = [sorted(cells[key][size]) for size in sizes]
        samples = [cell[:-1] if len(cell) > 1 else cell for cell in samples]
        dumped.append((key, sizes, [np.array(cell).tobytes() for cell in samples]))
    return dumped


def by_rows(text: str) -> ProfileSet:
    """The row-by-row (csv module) reader alone, as the fast reader falls back to it."""
    return _group_kairos_columns(_read_kairos_columns(text, "t.csv"), "t.csv", True)


def outcome(parse: Callable[[str], ProfileSet], text: str) -> tuple[str, str] | Dumped:
    try:
        return dump(parse(text))
    except (ProfileError, csv.Error) as error:
        return type(error).__name__, str(error)


def fast(text: str) -> ProfileSet:
    return _parse_kairos_csv(text, "t.csv")


def generated_csv(seed: int, line_end: str = "\n", final_end: bool = True) -> str:
    """Three models on two types, three batch sizes, four samples a cell, rows shuffled, an extra
    column, the columns reordered, numbers written in several plain ways, some ties."""
    rng = np.random.default_rng(seed)
    rows = []
    for model in ("rm2", "ncf", "modèle-ü"):
        for instance_type in ("t3.xlarge", "g4dn.xlarge"):
            for batch in (1, 20, 300):
                for sample in range(4):
                    infer = float(rng.uniform(0.0, 50.0))
                    load = [0.0, 1.5, float(rng.uniform(0.0, 5.0))][rng.integers(3)]
                    infer_text = [f"{infer:.3f}", repr(infer), f"{infer:.0f}", f"{infer:.1f}"][
                        rng.integers(4)
                    ]
                    rows.append(
                        f"{sample},{load!r},{model},{batch},x{sample},{infer_text},{instance_type}"
                    )
    order = rng.permutation(len(rows))
    header = "sample, load_ms ,model,batch_size,note,infer_ms,instance_type"
    text = line_end.join([header, *(rows[i] for i in order)])
    return text + line_end if final_end else text


@pytest.mark.parametrize(
    ("line_end", "final_end"), [("\n", True), ("\n", False), ("\r\n", True), ("\r\n", False)]
)
@pytest.mark.parametrize("seed", [0, 1])
def test_fast_reader_matches_a_straightforward_parse(
    seed: int, line_end: str, final_end: bool
) -> None:
    text = generated_csv(seed, line_end, final_end)
    assert _read_kairos_columns_fast(text) is not None  # the fast path read it, not the fallback
    expected = reference_profiles(text)
    assert dump(fast(text)) == expected
    assert dump(by_rows(text)) == expected


def test_fast_reader_matches_on_a_file_read_from_disk(tmp_path: Path) -> None:
    path = tmp_path / "profiles.csv"
    path.write_bytes(generated_csv(3, "\r\n").encode("utf-8"))
    profiles = load_profiles(path)
    assert profiles.source == str(path)
    assert dump(profiles) == reference_profiles(generated_csv(3, "\r\n"))


@pytest.mark.parametrize(
    "value",
    [
        "1e3", "+1.5", " 2.5", "2.5 ", "1_0", ".5", "5.", "007", "0.1000000000000000055511151231",
        "123456789012345678", "1E-2", "inf", "\u0661\u0662",
    ],
)  # fmt: skip
def test_numbers_the_fast_parse_leaves_to_float_agree(value: str) -> None:
    text = f"{HEADER}\nm,x,10,0,{value},0.25\nm,x,10,1,3,0.25\n"
    assert outcome(fast, text) == outcome(by_rows, text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty file"),
        (f"{HEADER}\n", "no data rows"),
        (f"{HEADER}\r\n", "no data rows"),
        ("model,instance_type,batch_size\nm,x,1\n", "missing column(s) sample, infer_ms, load_ms"),
        (f"{HEADER}\nm,x,10,0,1\n", "line 2 has 5 fields, expected 6"),
        # Two ragged rows whose fields add up: the count per line is checked, not the total.
        (f"{HEADER}\nm,x,10,0,1\nm,x,10,0,1,2,3\n", "line 2 has 5 fields, expected 6"),
        (f"{HEADER}\nm,x,10,0,1,2\n\nm,x,10,1,1,2\n", "line 3 has 0 fields, expected 6"),
        (f"{HEADER}\nm,x,10,0,1,2\nm,x,10,1,abc,2\n", "line 3: infer_ms 'abc' is not a number"),
        (f"{HEADER}\nm,x,10,0,1,\n", "line 2: load_ms '' is not a number"),
        (f"{HEADER}\nm,x,1.2.3,0,1,2\n", "line 2: batch_size '1.2.3' is not a number"),
        (f"{HEADER}\nm,x,10,0,1,2\nm,x,10,1,-5,2\n", "line 3 needs batch_size >= 1"),
        (f"{HEADER}\nm,x,0,0,1,2\n", "line 2 needs batch_size >= 1"),
        (f"{HEADER}\nm,x,10,0,nan,2\n", "line 2 needs batch_size >= 1"),
        (f"{HEADER}\nm,x,10,0,1,2\r\nm,x,10,1,1\r,2\n", "new-line character seen"),
    ],
)
def test_malformed_rows_give_the_same_error_either_way(text: str, message: str) -> None:
    fast_outcome, by_rows_outcome = outcome(fast, text), outcome(by_rows, text)
    assert fast_outcome == by_rows_outcome
    assert isinstance(fast_outcome, tuple) and message in fast_outcome[1]


def test_files_the_fast_reader_declines_read_as_before() -> None:
    quoted = f'{HEADER}\n"a,b",x,10,0,1,2\n"a,b",x,10,1,3,4\nc,"x",10,0,1,2\n'
    long_name = f"{HEADER}\n{'m' * 100},x,10,0,1,2\n"
    lone_return_at_the_end = f"{HEADER}\nm,x,10,0,1,2\r\nm,x,10,1,3,4\r"
    blank_lines_at_the_end = f"{HEADER}\nm,x,10,0,1,2\nm,x,10,1,3,4\n\n\n"
    for text in (quoted, long_name, lone_return_at_the_end, blank_lines_at_the_end):
        assert _read_kairos_columns_fast(text) is None
        assert dump(fast(text)) == reference_profiles(text)


numbers = st.one_of(
    st.floats(min_value=0.0, max_value=1e6).map(repr),
    st.tuples(st.floats(min_value=0.0, max_value=1e4), st.integers(0, 12)).map(
        lambda pair: f"{pair[0]:.{pair[1]}f}"
    ),
    st.text(alphabet="0123456789.", min_size=1, max_size=20),
    st.text(alphabet="0123456789.+-eE_ x", max_size=6),
)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["m", "n"]),
            st.sampled_from(["x", "y", "z"]),
            st.sampled_from(["1", "2", "10", "2.5"]),
            numbers,
            numbers,
        ),
        min_size=1,
        max_size=12,
    ),
    st.sampled_from(["\n", "\r\n"]),
)
def test_fast_and_row_by_row_readers_agree(
    rows: list[tuple[str, str, str, str, str]], line_end: str
) -> None:
    lines = [HEADER] + [f"{m},{t},{b},0,{infer},{load}" for m, t, b, infer, load in rows]
    text = line_end.join(lines) + line_end
    assert outcome(fast, text) == outcome(by_rows, text)


# --- arrivals ---------------------------------------------------------------------------------

rate_profiles = [
    RateProfile(np.array([0.0]), np.array([7.0])),
    step_profile(100.0, 300.0, 5.0),
    step_profile(0.0, 300.0, 2.0, 3.0),
    step_profile(300.0, 0.0, 2.0, 3.0),
    diurnal_profile(50.0, 100.0, period_s=30.0, amplitude=1.0),
    with_spikes(diurnal_profile(50.0, 100.0, period_s=30.0), [(10.0, 5.0, 0.0), (40.0, 1.0, 9.0)]),
    RateProfile(np.array([0.0, 1.0, 1.0 + 1e-12, 5.0, 5.0]), np.array([10.0, 0.0, 20.0, 5.0, 0.0])),
    RateProfile(np.array([-0.0, 0.1, 0.3, 0.7]), np.array([3.0, 3.0, 0.7, 0.7])),
    # Steps where y / rate just below a knot rounds past the piece's end (the clip to its length).
    RateProfile(
        np.array(
            [0.0, 2.2392164891073794, 2.2392164891073794, 9.541703736368754, 9.541703736368754]
        ),
        np.array([665.7552598178679, 665.7552598178679, 666.5107496986203, 666.5107496986203, 9.0]),
    ),
]


@pytest.mark.parametrize("profile", rate_profiles)
def test_sorted_inversion_matches_the_general_one_bit_for_bit(profile: RateProfile) -> None:
    total = float(profile.cumulative(120.0))
    knots = profile._knot_cumulative()
    expected = np.sort(
        np.concatenate(
            (
                np.random.default_rng(0).uniform(0.0, total * 1.2, 20_000),
                np.linspace(0.0, total, 20_001),
                knots,  # values at the knots and an ulp either side (rounding clips dt there)
                np.nextafter(knots, -np.inf),
                np.nextafter(np.nextafter(knots, -np.inf), -np.inf),
                np.nextafter(np.nextafter(np.nextafter(knots, -np.inf), -np.inf), -np.inf),
                np.nextafter(knots, np.inf),
                [-0.0, 0.0, 0.0, total * 5.0],
            )
        )
    )
    fast_s = profile._inverse_cumulative_sorted(expected)
    assert fast_s.tobytes() == profile.inverse_cumulative(expected).tobytes()


random_profiles = st.lists(
    st.tuples(
        st.one_of(st.just(0.0), st.floats(min_value=1e-9, max_value=50.0)),
        st.one_of(st.just(0.0), st.floats(min_value=1e-3, max_value=1000.0)),
    ),
    min_size=1,
    max_size=8,
).map(
    lambda knots: RateProfile(
        np.concatenate(([0.0], np.cumsum([gap for gap, _ in knots[1:]]))),
        np.array([rate for _, rate in knots]),
    )
)


@settings(max_examples=150, deadline=None)
@given(random_profiles, st.lists(st.floats(min_value=0.0, max_value=5e4), max_size=30))
def test_sorted_inversion_matches_on_random_profiles(
    profile: RateProfile, values: list[float]
) -> None:
    knots = profile._knot_cumulative()
    expected = np.sort(
        np.concatenate((values, knots, np.nextafter(knots, -np.inf), np.nextafter(knots, np.inf)))
    )
    fast_s = profile._inverse_cumulative_sorted(expected)
    assert fast_s.tobytes() == profile.inverse_cumulative(expected).tobytes()
