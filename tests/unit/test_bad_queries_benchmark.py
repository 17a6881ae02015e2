"""``benchmarks/bad_queries.py``'s app spec, which needs no service (the benchmark itself starts
one and is run by hand)."""

from __future__ import annotations

from pathlib import Path

from benchmarks import bad_queries
from controlplane.spec import confine_paths, validate_spec


def test_the_app_spec_names_a_profile_file_the_api_takes(tmp_path: Path) -> None:
    # The API takes a spec's files from its data directory only (confine_paths): the benchmark's
    # profile file beside the model, outside it, made the app's registration a 422.
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    spec = validate_spec(bad_queries.app_spec(data_dir))
    confine_paths(spec, data_dir)  # raises SpecError for a file outside it
    assert Path(spec.models[0].profiles or "").is_file()
