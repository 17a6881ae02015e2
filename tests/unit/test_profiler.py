"""The profiler and ``heteroplane profile``: profiles measured through real worker processes (the
serving path) and in process (compute only), emulated types, the workers stopped, bad input."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

from controlplane.apps import profiler
from controlplane.apps.profiler import (
    REFERENCE_TYPE,
    MeasureSettings,
    ProfilingError,
    emulated_profiles,
    emulated_types,
    measure_family,
    measure_serving_path,
    parse_batch_sizes,
)
from controlplane.cli import main
from estimator.catalog import InstanceType, default_catalog
from estimator.profiles import LatencyProfile, load_profiles
from provisioners import local
from provisioners.worker.emulation import EMULATED_COMPUTE, ComputeCurve, compute_document

FEW = ["--samples", "3", "--warmup", "1"]


def bad_input(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run the command line, expect exit status 2; return its one line of stderr."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_measure_family_times_each_model_and_batch_size(trained_family: Path) -> None:
    profiles = measure_family(
        ["tiny", "large"], (1, 4), MeasureSettings(samples=3, warmup=1), cache_dir=trained_family
    )
    assert [(p.model, p.instance_type) for p in profiles] == [
        ("tiny", REFERENCE_TYPE),
        ("large", REFERENCE_TYPE),
    ]
    for profile in profiles:
        assert profile.batch_sizes.tolist() == [1, 4]
        assert all(cell.size == 3 for cell in profile.samples_ms)
        assert all(math.isfinite(v) and v > 0 for cell in profile.samples_ms for v in cell)


def test_emulated_profiles_divide_by_the_speed_factor() -> None:
    base = LatencyProfile(
        "m", REFERENCE_TYPE, np.array([1, 8]), (np.array([2.0, 4.0]), np.array([8.0]))
    )
    slow, fast = (
        InstanceType("emu.a", 0.1, speed_factor=0.5),
        InstanceType("emu.b", 1, speed_factor=4),
    )
    derived = emulated_profiles([base], [slow, fast])
    assert [(p.model, p.instance_type) for p in derived] == [("m", "emu.a"), ("m", "emu.b")]
    assert derived[0].mean_ms.tolist() == [6.0, 16.0]
    assert derived[1].mean_ms.tolist() == [0.75, 2.0]


def test_with_compute_curves_an_emulated_type_takes_what_its_worker_pads_to() -> None:
    base = LatencyProfile(
        "m", REFERENCE_TYPE, np.array([1, 8]), (np.array([2.0, 4.0]), np.array([80.0]))
    )
    slow = InstanceType("emu.a", 0.1, speed_factor=0.5)
    (derived,) = emulated_profiles([base], [slow], {"m": ComputeCurve(4.0, 2.0)})
    # (4 + 2 b) / 0.5, except where this machine computes slower still (80 > 20 / 0.5).
    assert derived.mean_ms.tolist() == [12.0, 80.0]


class RecordingProvisioner(local.LocalProvisioner):
    """The local provisioner, remembering every one made (to check that its workers are gone)."""

    made: ClassVar[list[local.LocalProvisioner]] = []

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        type(self).made.append(self)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[-1].split()[0] == "Z"


def test_the_serving_path_is_timed_through_a_worker_of_each_type_and_they_stop(
    trained_family: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    RecordingProvisioner.made = []
    monkeypatch.setattr(local, "LocalProvisioner", RecordingProvisioner)
    catalog = default_catalog()
    types = [catalog[REFERENCE_TYPE], catalog["emu.cpu.small"]]
    said: list[str] = []
    compute = {"tiny": ComputeCurve(1.0, 2.0), "large": ComputeCurve(2.0, 3.0)}
    profiles = measure_serving_path(
        ["tiny", "large"],
        (1, 4),
        types,
        MeasureSettings(samples=3, warmup=1),
        cache_dir=trained_family,
        compute=compute,
        progress=said.append,
    )
    assert [(p.model, p.instance_type) for p in profiles] == [
        ("tiny", REFERENCE_TYPE),
        ("large", REFERENCE_TYPE),
        ("tiny", "emu.cpu.small"),
        ("large", "emu.cpu.small"),
    ]
    for profile in profiles:
        assert profile.batch_sizes.tolist() == [1, 4]
        assert all(cell.size == 3 for cell in profile.samples_ms)
        assert all(math.isfinite(v) and v > 0 for cell in profile.samples_ms for v in cell)
        if profile.instance_type == "emu.cpu.small":
            # The worker padded each batch to C(b) / 0.5; the round trip adds to that.
            for b, cell in zip((1, 4), profile.samples_ms, strict=True):
                assert cell.min() >= compute[profile.model].latency_ms(b) / 0.5
    assert any("starting a worker of each of local.cpu, emu.cpu.small" in line for line in said)
    (provisioner,) = RecordingProvisioner.made
    assert provisioner.records() == []  # every worker stopped and forgotten
    assert not provisioner.state_dir.exists()  # the scratch directory is gone too


def test_a_worker_that_does_not_start_is_a_profiling_error_and_is_cleaned_up(
    trained_family: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Broken(RecordingProvisioner):
        def _command(self, *args: object) -> list[str]:
            return [sys.executable, "-c", "import sys; sys.exit('worker: no torch here')"]

    Broken.made = []
    monkeypatch.setattr(local, "LocalProvisioner", Broken)
    with pytest.raises(ProfilingError, match="no torch here"):
        measure_serving_path(
            ["tiny"],
            (1,),
            [default_catalog()["emu.gpu"]],
            MeasureSettings(samples=1, warmup=0),
            cache_dir=trained_family,
        )
    (provisioner,) = Broken.made
    assert all(gone(r.pid) for r in provisioner.records())


def test_the_default_catalog_emulates_three_types() -> None:
    names = {t.name: t.speed_factor for t in emulated_types(default_catalog())}
    assert names == {"emu.cpu.small": 0.5, "emu.cpu.large": 1.0, "emu.gpu": 4.0}


def test_parse_batch_sizes() -> None:
    assert parse_batch_sizes("4, 1,2") == (1, 2, 4)
    for text, message in [
        ("1,x", "not a whole number"),
        ("0,2", "outside"),
        ("2,2", "repeat"),
        ("1,,2", "separated by commas"),
        ("", "separated by commas"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_batch_sizes(text)


def test_measure_writes_end_to_end_profiles_and_the_compute_the_workers_pad_to(
    trained_family: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "profiles.json"
    argv = ["profile", "measure", "--cache-dir", str(trained_family), "--out", str(out)]
    options = ["--models", "tiny,medium", "--batch-sizes", "1,2", "--instance-types", "emu.gpu"]
    assert main([*argv, *options, *FEW, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["instance_types"] == [REFERENCE_TYPE, "emu.gpu"]
    assert summary["measurement"] == "serving_path"

    profiles = load_profiles(out)
    assert len(profiles) == 2 * 2
    for model in ("tiny", "medium"):
        reference = profiles.get_profile(model, REFERENCE_TYPE)
        assert reference.batch_sizes.tolist() == [1, 2]
        assert np.all(np.isfinite(reference.mean_ms)) and np.all(reference.mean_ms > 0)
        emulated = profiles.get_profile(model, "emu.gpu")
        curve = EMULATED_COMPUTE[model]
        # The compute it pads to, C(b) / 4, and the serving path on top of it.
        floor = np.array([curve.latency_ms(1), curve.latency_ms(2)]) / 4.0
        assert np.all(emulated.mean_ms >= floor)
    meta = json.loads(out.read_text())
    assert meta["format"] == "heteroplane.profiles/v1"
    assert meta["source"] == "measured" and meta["reference_type"] == REFERENCE_TYPE
    assert meta["measurement"] == "serving_path"
    assert meta["compute"] == compute_document({m: EMULATED_COMPUTE[m] for m in ("tiny", "medium")})
    for key in ("host", "numpy", "date"):
        assert meta[key]

    assert main(["profile", "show", str(out), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert len(shown["profiles"]) == 4 and shown["models"] == ["medium", "tiny"]
    assert shown["measurement"] == "serving_path" and shown["compute"] == meta["compute"]
    assert main(["profile", "show", str(out)]) == 0
    text = capsys.readouterr().out
    assert "emu.gpu" in text and "end to end" in text and "tiny: base_ms 4.0" in text


def test_measure_compute_only_times_in_process_every_emulated_type_by_default(
    trained_family: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "profiles.json"
    argv = ["profile", "measure", "--cache-dir", str(trained_family), "--out", str(out)]
    options = ["--models", "tiny,medium", "--batch-sizes", "1,2,4", "--compute-only"]
    assert main([*argv, *options, *FEW, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["instance_types"] == [
        REFERENCE_TYPE,
        "emu.cpu.small",
        "emu.cpu.large",
        "emu.gpu",
    ]
    assert summary["models"] == ["tiny", "medium"]
    assert summary["measurement"] == "compute_only"

    profiles = load_profiles(out)
    assert len(profiles) == 2 * 4
    catalog = default_catalog()
    for model in ("tiny", "medium"):
        measured = profiles.get_profile(model, REFERENCE_TYPE)
        assert measured.batch_sizes.tolist() == [1, 2, 4]
        assert np.all(np.isfinite(measured.mean_ms)) and np.all(measured.mean_ms > 0)
        curve = EMULATED_COMPUTE[model]
        for name in ("emu.cpu.small", "emu.cpu.large", "emu.gpu"):
            emulated = profiles.get_profile(model, name)
            padded = np.array([curve.latency_ms(b) for b in (1, 2, 4)])
            # Sub-millisecond digits models: the padded compute wins on (almost) every sample;
            # a sample the machine stalled past it stays, so the median is the padded compute
            # and no sample is below it.
            wanted = padded / catalog[name].speed_factor
            medians = [float(np.median(cell)) for cell in emulated.samples_ms]
            np.testing.assert_allclose(medians, wanted)
            assert all(
                np.all(cell >= w) for cell, w in zip(emulated.samples_ms, wanted, strict=True)
            )
    assert json.loads(out.read_text())["measurement"] == "compute_only"


def test_measure_takes_chosen_types_and_a_catalog(
    trained_family: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    catalog = tmp_path / "catalog.csv"
    catalog.write_text("instance_type,price_usd_per_hr,speed_factor\nmy.box,0.2,2.0\n")
    out = tmp_path / "p.json"
    argv = ["profile", "measure", "--cache-dir", str(trained_family), "--out", str(out), *FEW]
    more = ["--catalog", str(catalog), "--instance-types", "my.box,local.cpu", "--models", "tiny"]
    assert main([*argv, *more, "--batch-sizes", "1", "--compute-only"]) == 0
    capsys.readouterr()
    profiles = load_profiles(out)
    assert sorted(profiles) == [("tiny", REFERENCE_TYPE), ("tiny", "my.box")]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--models", "tiny,huge"], "unknown model 'huge'"),
        (["--models", "tiny,tiny"], "twice"),
        (["--batch-sizes", "1,two"], "--batch-sizes: batch size 'two' is not a whole number"),
        (["--batch-sizes", "0"], "outside"),
        (["--samples", "0"], "--samples must be >= 1"),
        (["--instance-types", "emu.nope"], "emu.nope"),
        (["--instance-types", "g4dn.xlarge"], "real instance type"),
        (["--instance-types", "emu.gpu,emu.gpu"], "--instance-types: emu.gpu given twice"),
    ],
)
def test_measure_refuses_bad_input(
    trained_family: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    options: list[str],
    message: str,
) -> None:
    out = tmp_path / "p.json"
    argv = ["profile", "measure", "--cache-dir", str(trained_family), "--out", str(out)]
    assert message in bad_input(capsys, *argv, *options)
    assert not out.exists()


def test_measure_refuses_an_unwritable_out_path_before_measuring(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("measured before checking --out")

    monkeypatch.setattr(profiler, "measure_family", never)
    monkeypatch.setattr(profiler, "measure_serving_path", never)
    cache = str(tmp_path / "unused")
    missing = tmp_path / "no" / "such" / "dir" / "p.json"
    argv = ["profile", "measure", "--cache-dir", cache]
    assert "does not exist" in bad_input(capsys, *argv, "--out", str(missing))
    assert "is a directory" in bad_input(capsys, *argv, "--out", str(tmp_path))


def test_show_refuses_a_missing_or_bad_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "cannot read" in bad_input(capsys, "profile", "show", str(tmp_path / "none.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"profiles": 3}')
    assert "profiles" in bad_input(capsys, "profile", "show", str(bad))


def test_a_worker_that_breaks_every_connection_is_the_runs_failure_not_a_traceback() -> None:
    """A worker that closed the connection on a batch it would not take (one far past its body
    limit) broke the retry too, and BrokenPipeError's traceback was the API's 500."""
    import socket
    import threading

    from controlplane.apps.profiler import ProfilingError, WorkerClient

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def close_each() -> None:
        for _ in range(2):  # the call and its retry
            connection, _address = listener.accept()
            connection.close()

    closer = threading.Thread(target=close_each, daemon=True)
    closer.start()
    client = WorkerClient(f"127.0.0.1:{port}", timeout_s=5.0)
    try:
        with pytest.raises(ProfilingError, match="broke the connection on a batch of 2 of m twice"):
            client.infer_ms("m", {"input": np.zeros((2, 4), np.float32)})
    finally:
        client.close()
        closer.join(timeout=5.0)
        listener.close()


def test_a_batch_the_worker_does_not_answer_in_time_is_a_timeout_and_is_not_sent_again() -> None:
    """A batch of 4,096 that an emulated worker serves in about 123 s was sent twice, each
    waiting out the minute's timeout, and answered "broke the connection ... twice:
    TimeoutError": it is one timeout, said as one, with how long was waited."""
    import socket
    import threading

    from controlplane.apps.profiler import ProfilingTimeoutError, WorkerClient

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    accepted: list[socket.socket] = []
    done = threading.Event()

    def hold_each() -> None:  # takes the request and never answers, until the test is done
        listener.settimeout(0.1)
        while not done.is_set():
            try:
                connection, _address = listener.accept()
            except TimeoutError:
                continue
            accepted.append(connection)

    holder = threading.Thread(target=hold_each, daemon=True)
    holder.start()
    client = WorkerClient(f"127.0.0.1:{port}", timeout_s=0.3)
    try:
        with pytest.raises(ProfilingTimeoutError) as caught:
            client.infer_ms("m", {"input": np.zeros((2, 4), np.float32)})
    finally:
        client.close()
        done.set()
        holder.join(timeout=5.0)
        listener.close()
        for connection in accepted:
            connection.close()
    assert str(caught.value) == (
        f"the worker at 127.0.0.1:{port} timed out on a batch of 2 of m: no answer within"
        " 0.3 s (the profiler's call timeout); a batch that size takes longer there, or the"
        " worker is stuck: profile smaller batch sizes"
    )
    assert isinstance(caught.value, ProfilingError) and len(accepted) == 1  # not sent again
