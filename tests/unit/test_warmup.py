"""The kernels' warm-up (estimator/warmup.py), which ``make test``'s install runs so that the test
processes find numba's cache instead of each compiling the kernels: it runs, and after it every
cached kernel of the two numerical packages has its cache on disk."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

from numba.core.caching import FunctionCache
from numba.core.registry import CPUDispatcher

import estimator
import matching
from estimator import warmup

ROOT = Path(__file__).resolve().parents[2]


def _cached_kernels() -> dict[str, CPUDispatcher]:
    """Every numba kernel of ``estimator`` and ``matching`` compiled with ``cache=True`` and
    compiled on its own (a kernel inlined into its callers has no cache of its own)."""
    found: dict[str, CPUDispatcher] = {}
    for package in (estimator, matching):
        for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
            if info.name.endswith("__main__"):
                continue
            module = importlib.import_module(info.name)
            for name, value in vars(module).items():
                if (
                    isinstance(value, CPUDispatcher)
                    and value.__module__ == module.__name__
                    and isinstance(value._cache, FunctionCache)
                    and value.targetoptions.get("inline") != "always"
                ):
                    found[f"{module.__name__}.{name}"] = value
    return found


def test_the_warm_up_leaves_every_cached_kernel_in_the_cache() -> None:
    kernels = _cached_kernels()
    # The simulator's FCFS kernel, the envelopes, Kairos' rounds and the chain flow at least.
    assert {
        "estimator.kernels.fcfs_kernel",
        "estimator.envelope._max_arrivals",
        "matching.kairos.round_flow_kernel",
        "matching.chain_flow.chain_assignment_kernel",
    } <= set(kernels)
    warmup.warm()
    missing = [
        name
        for name, kernel in kernels.items()
        if not Path(kernel._cache._cache_file._index_path).is_file()
    ]
    assert not missing, f"not compiled by the warm-up: {missing}"


def test_the_command_says_what_it_did() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "estimator.warmup"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("compiled the numerical kernels (")
