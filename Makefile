# The two commands a newcomer needs (see README.md):
#   make demo   runs the main job: the control plane with the demo app, until Ctrl-C
#   make test   runs the whole test suite (lint, types, tests)
# Each bootstraps a virtualenv in .venv with the editable install on first use.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The demo needs the worker extra (torch, scikit-learn, onnxruntime); the tests also the test
# extra (pytest, ruff, mypy, a browser driver, ...), which brings the optional extras the tests
# cover: aws (boto3: the EC2 provisioner), postgres (psycopg) and bench (matplotlib: the result
# plots). One virtualenv, a stamp per install.
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-worker
# Extra pip options for the installs. CI passes --no-compile: pip then compiles no bytecode for
# the thousands of modules installed (about 40 s of a core for torch and the rest); the test
# install compiles what the tests import instead (below).
PIP_FLAGS ?=

.PHONY: demo test lint style bench reproduce results clean

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "heteroplane needs Python >= 3.11; set PYTHON=python3.11 (or newer)")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(DEMO_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet $(PIP_FLAGS) -e '.[worker]'
	@touch $(DEMO_STAMP)

# The test install ends by collecting the suite once, which imports what the tests import and
# writes its bytecode (the libraries', the project's, pytest's rewritten test modules), even where
# the environment says not to (PYTHONDONTWRITEBYTECODE, below): otherwise the four test processes
# of a first `make test` compile all of it at once, each for itself (a collection 31 s of a core
# with nothing compiled, 8.5 s with it: docs/status.md, "The test suite"). A collection error is
# not the install's: the test run reports it. Beside it, on the other core, numba's kernels are
# compiled into their cache (python -m estimator.warm, about 20 s of a core), which the tests'
# first users of them compiled otherwise (the results' quick runs, in the test run's time:
# docs/status.md, "What was cut"). If that fails, the tests compile them.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet $(PIP_FLAGS) -e '.[test,worker]'
	@echo "compiling the bytecode of what the tests import (a collection of the suite) and the kernels"
	@$(BIN)/python -m estimator.warm > $(VENV)/warm.log 2>&1 & warm=$$!; \
	PYTHONDONTWRITEBYTECODE= $(BIN)/pytest --collect-only -q -p no:cacheprovider > /dev/null 2>&1; \
	wait $$warm || echo "the kernels were not compiled ahead (python -m estimator.warm failed: $(VENV)/warm.log); the tests compile them"
	@touch $(STAMP) $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/heteroplane demo

lint: style
	$(BIN)/mypy

# The checks of lint but the type check (a few seconds).
style: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

# Four processes on the 2-core machine, a test file per process at a time (its fixtures stay
# together): the suite's long tests (terraform against moto, the demo's loadgen replay, the
# README commands against a real demo) mostly wait on other processes, so the others run the
# rest meanwhile (with three, the cores stood idle 9.5% of the run, with four 3.7%; five made
# more processes share the cores than the end-to-end tests' own checks allow: docs/status.md).
# tests/conftest.py puts the slow tests first, and --no-loadscope-reorder keeps that order
# (xdist would otherwise hand out the files with the most tests first, leaving the one-test
# replay to start last and run alone). Bytecode is cached even where the environment says not
# to (PYTHONDONTWRITEBYTECODE, set on the machines this was written on): the suite starts some
# 300 Python processes (services, workers, the CLI), each of which would compile the
# repository's modules again, and pytest rewrites the test modules' asserts in every process
# (13 s of a core) unless it may cache them.
# The type check (mypy: about 45 s of a core) is `make lint`'s, not this target's: run beside
# the tests it took that core from them, and the suite on two cores is bound by its CPU (CI runs
# both: .ci/run).
test: style
	PYTHONDONTWRITEBYTECODE= $(BIN)/pytest -q -n 4 --dist loadfile --no-loadscope-reorder --durations=15

# The quick set: each speed benchmark in its quick mode (small sizes, one repeat; about 30 s in all
# on a 2-core machine, indicative figures only). Full runs, and which script answers which
# question: benchmarks/README.md.
bench: $(STAMP)
	$(BIN)/python benchmarks/estimator_speed.py --quick
	$(BIN)/python benchmarks/bounds_speed.py --quick
	$(BIN)/python benchmarks/matching_speed.py --quick
	$(BIN)/python benchmarks/planner_speed.py --quick
	$(BIN)/python benchmarks/gear_planner_speed.py --quick
	$(BIN)/python benchmarks/profile_load.py
	$(BIN)/python benchmarks/cli_speed.py
	$(BIN)/python -m benchmarks.serving_speed dispatcher --quick
	$(BIN)/python -m benchmarks.serving_speed layers --quick

reproduce: $(STAMP)
	$(BIN)/python benchmarks/kairos_reproduction.py

# Every result table and plot into docs/results, and the README's results block (about 25 min, and
# the held-out autoscaling section about 30 min more;
# benchmarks/results/__main__.py). `make results QUICK=1` is the small version CI runs.
results: $(STAMP)
	$(BIN)/python -m benchmarks.results $(if $(QUICK),--quick)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
