"""``benchmarks/bad_queries.py``'s app spec, which needs no service (the benchmark itself starts
one and is run by hand)."""

from __future__ import annotations

from pathlib import Path

from benchmarks import bad_queries
from controlplane.provisioning import LOCAL_PROFILE_FILE
from controlplane.spec import confine_paths, validate_spec
from estimator.profiles import load_profiles


def test_the_app_spec_names_a_profile_file_the_api_takes(tmp_path: Path) -> None:
    # The API takes a spec's files from its data directory only (confine_paths): the benchmark's
    # profile file beside the model, outside it, made the app's registration a 422.
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    spec = validate_spec(bad_queries.app_spec(data_dir))
    confine_paths(spec, data_dir)  # raises SpecError for a file outside it
    assert Path(spec.models[0].profiles or "").is_file()


def test_the_worker_pads_to_the_curve_the_app_plans_on(tmp_path: Path) -> None:
    # The worker answered in about a millisecond and the plan's batch was 1, so no poison query
    # ever shared a batch: the data directory's profile file (which the local provisioner hands
    # its workers, to pad to) now holds a curve on which 100 q/s must go in batches.
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    bad_queries.app_spec(data_dir)
    curve = load_profiles(data_dir / LOCAL_PROFILE_FILE)[
        (bad_queries.MODEL, bad_queries.INSTANCE_TYPE)
    ]
    assert curve.batch_sizes[0] == 1
    assert 1000.0 / curve.mean_ms[0] < 100.0  # a batch of one does not keep up with 100 q/s
