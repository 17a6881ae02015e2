"""The results command's quick mode, the second half of the experiments (the first half and
the checks are in tests/integration/test_results.py: two files, so that two test processes run
the halves at once)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.results.__main__ import EXPERIMENTS
from tests.integration.test_results import FIRST_HALF, quick_run_writes


@pytest.mark.slow
def test_quick_mode_writes_the_second_half_of_the_sections(tmp_path: Path) -> None:
    chosen = [(module, key) for module, key in EXPERIMENTS if module not in FIRST_HALF]
    assert chosen, "the first half is every experiment"
    quick_run_writes(tmp_path, [m for m, _ in chosen], [k for _, k in chosen])
