"""``python -m estimator.warm``: every cached kernel of the estimator and the matching library has
its compiled code in numba's cache once it has run.

In a checkout whose install already ran it (the Makefile's), the run here loads the kernels
from that cache in well under a second; what is checked is that it ran and that each kernel
numba would otherwise compile at its first call (``cache=True``, not inlined into its callers)
has an index of compiled signatures where numba looks for one.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from typing import Any

import pytest
from numba.core.registry import CPUDispatcher

import estimator
import matching
from estimator import warm


def cached_kernels() -> dict[str, CPUDispatcher]:
    """Every compiled kernel of the two libraries that numba caches on disk, by name."""
    found = {}
    for package in (estimator, matching):
        for info in pkgutil.iter_modules(package.__path__, f"{package.__name__}."):
            module = importlib.import_module(info.name)
            for value in vars(module).values():
                if (
                    isinstance(value, CPUDispatcher)
                    and value.py_func.__module__ == module.__name__
                    and value.targetoptions.get("inline") != "always"  # compiled in its callers
                    and type(getattr(value, "_cache", None)).__name__ == "FunctionCache"
                ):
                    found[f"{module.__name__}.{value.py_func.__name__}"] = value
    return found


def index_path(kernel: Any) -> Path:
    """Where numba looks for ``kernel``'s index of compiled signatures."""
    return Path(kernel._cache._cache_file._index_path)


def test_the_warm_up_leaves_every_cached_kernel_compiled_in_the_cache(
    capsys: pytest.CaptureFixture[str],
) -> None:
    kernels = cached_kernels()
    # The libraries' kernels at the time of writing: the search must find them.
    assert {"matching.kairos.round_flow_kernel", "estimator.envelope._max_arrivals_py"} <= set(
        kernels
    )
    assert warm.main() == 0
    assert capsys.readouterr().out.startswith("compiled kernels cached (")
    missing = [name for name, kernel in kernels.items() if not index_path(kernel).is_file()]
    assert not missing, f"not in numba's cache after the warm-up: {missing}"
