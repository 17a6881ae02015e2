"""Every module's doctests run: the examples in the docstrings are part of the contract, so each
module of the four packages is collected here (one test per module), not a hand-picked few."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

PACKAGES = ("estimator", "matching", "controlplane", "provisioners")
# `python -m controlplane` runs the command line when imported.
SKIPPED = {"controlplane.__main__"}


def _modules() -> list[str]:
    names = []
    for package in PACKAGES:
        root = importlib.import_module(package)
        names.append(package)
        for info in pkgutil.walk_packages(root.__path__, f"{package}."):
            if info.name not in SKIPPED:
                names.append(info.name)
    return sorted(names)


MODULES = _modules()


def test_every_package_module_is_collected() -> None:
    assert len(MODULES) > 100
    assert {"controlplane.policies.plan", "estimator.simulator", "matching.assignment"} <= set(
        MODULES
    )


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, raise_on_error=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} doctests failed in {name}"
