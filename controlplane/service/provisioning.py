"""Moved to :mod:`controlplane.provisioning` (below the registry, which asks the provider for its
artifact store); this name is kept for the scripts of ``benchmarks/`` that import it."""

from __future__ import annotations

from controlplane.provisioning import (
    FACTORIES,
    LOCAL_FAMILIES,
    LOCAL_MODELS_DIR,
    LOCAL_PROFILE_FILE,
    LOCAL_WORKERS_DIR,
    ProvisionerFactory,
    build_provisioner,
    ec2_config_from,
    local_speed_factors,
)

__all__ = [
    "FACTORIES",
    "LOCAL_FAMILIES",
    "LOCAL_MODELS_DIR",
    "LOCAL_PROFILE_FILE",
    "LOCAL_WORKERS_DIR",
    "ProvisionerFactory",
    "build_provisioner",
    "ec2_config_from",
    "local_speed_factors",
]
