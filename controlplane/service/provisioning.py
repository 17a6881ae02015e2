"""Moved to :mod:`controlplane.provisioning` (below the registry, which asks the provider for its
artifact store). This name keeps the data-directory names the scripts of ``benchmarks/`` import
from here; new code imports :mod:`controlplane.provisioning`."""

from __future__ import annotations

from controlplane.provisioning import LOCAL_MODELS_DIR, LOCAL_PROFILE_FILE, LOCAL_WORKERS_DIR

__all__ = ["LOCAL_MODELS_DIR", "LOCAL_PROFILE_FILE", "LOCAL_WORKERS_DIR"]
