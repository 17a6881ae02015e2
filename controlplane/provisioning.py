"""Which provisioner the service runs with: settings in, a :class:`~provisioners.base.Provisioner`
out.

This module owns the conversion from the control plane's settings (pydantic, a trust boundary)
to the provisioners' own configuration (``provisioners`` imports nothing from here), and the
table of factories by ``settings.provisioner``. Adding a provisioner is its module in
``provisioners/``, one line in :data:`FACTORIES` and its block of settings (docs/design.md,
"Adding a provider"). It sits below the registry, which asks the provider where artifacts are
kept (:meth:`~provisioners.base.Provisioner.artifact_storage`).

>>> from controlplane.settings import Settings
>>> build_provisioner(Settings(provisioner="fake")).name
'fake'
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from controlplane.errors import SettingsError
from controlplane.policies.spot import SpotPricesFn
from controlplane.settings import Ec2Settings, Settings
from estimator.catalog import Catalog, default_catalog
from provisioners.base import Provisioner
from provisioners.errors import InvalidConfigurationError, ProvisionerError
from provisioners.interruptions import SpotPriceSource

if TYPE_CHECKING:  # provisioners.ec2 imports boto3, which is slow: only when needed
    from provisioners.ec2 import Ec2Config

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
    "provider_spot_prices",
]

logger = logging.getLogger(__name__)

ProvisionerFactory = Callable[[Settings], Provisioner]


def build_provisioner(settings: Settings) -> Provisioner:
    """The provisioner ``settings.provisioner`` names, configured from ``settings``.

    Raises :class:`SettingsError` when there is no such provisioner or its settings are
    unusable.
    """
    factory = FACTORIES.get(settings.provisioner)
    if factory is None:
        raise SettingsError(
            "provisioner",
            f"no provisioner {settings.provisioner!r} in this build"
            f" (have: {', '.join(sorted(FACTORIES))})",
        )
    return factory(settings)


def _ec2_module() -> ModuleType:
    """:mod:`provisioners.ec2`, imported when it is used: boto3 is slow to import, and it is the
    optional extra ``aws``."""
    try:
        return importlib.import_module("provisioners.ec2")
    except ModuleNotFoundError as error:
        if error.name not in ("boto3", "botocore"):
            raise
        raise SettingsError(
            "provisioner",
            f"ec2 needs {error.name}, which is not installed; install heteroplane with AWS"
            " support: pip install 'heteroplane[aws]'",
        ) from None


def ec2_config_from(ec2: Ec2Settings) -> Ec2Config:
    """The :class:`~provisioners.ec2.Ec2Config` for these settings."""
    config: type[Ec2Config] = _ec2_module().Ec2Config
    try:
        return config(
            region=ec2.region,
            subnet_ids=tuple(ec2.subnet_ids),
            security_group_ids=tuple(ec2.security_group_ids),
            ami_id=ec2.ami_id,
            launch_templates=dict(ec2.launch_templates),
            tag_prefix=ec2.tag_prefix,
            spot=ec2.spot,
            unavailable_ttl_s=ec2.unavailable_ttl_s,
            max_attempts=ec2.max_attempts,
            endpoint_url=ec2.endpoint_url,
            model_bucket=ec2.model_bucket,
            model_prefix=ec2.model_prefix,
            interruption_queue_url=ec2.interruption_queue_url,
            spot_price_ttl_s=ec2.spot_price_ttl_s,
            connect_timeout_s=ec2.connect_timeout_s,
            read_timeout_s=ec2.read_timeout_s,
        )
    except InvalidConfigurationError as error:
        raise SettingsError(f"ec2.{error.field}", error.problem) from None


def _build_ec2(settings: Settings) -> Provisioner:
    if settings.ec2 is None:
        raise SettingsError("ec2", "is required when provisioner is 'ec2'")
    config = ec2_config_from(settings.ec2)
    try:
        provisioner: Provisioner = _ec2_module().Ec2Provisioner(config)
        return provisioner
    except InvalidConfigurationError as error:
        raise SettingsError(f"ec2.{error.field}", error.problem) from None


def _build_fake(settings: Settings) -> Provisioner:
    from provisioners.fake import FakeProvisioner

    # In a running service nothing calls step(): instances start running at once.
    return FakeProvisioner(running_on_launch=True)


# The instance types the local provisioner runs: the catalog's emulated types and the reference
# machine (family "local"), which its workers emulate by their speed factors.
LOCAL_FAMILIES = ("emu", "local")
# Where, under the data directory, local workers keep their state and the family its models.
LOCAL_WORKERS_DIR = "workers"
LOCAL_MODELS_DIR = "models"
# The family's profile JSON there (what ``heteroplane profile measure`` and the demo write): when
# it is there as the service starts, local workers pad each batch to its curves, so that they
# serve in the latency the planner and the simulator were told (docs/catalog.md).
LOCAL_PROFILE_FILE = Path("profiles") / "family.json"


def local_speed_factors(catalog: Catalog) -> dict[str, float]:
    """The types the local provisioner runs, with their speed factors.

    >>> from estimator.catalog import default_catalog
    >>> sorted(local_speed_factors(default_catalog()))
    ['emu.cpu.large', 'emu.cpu.small', 'emu.gpu', 'local.cpu']
    """
    return {t.name: t.speed_factor for t in catalog.values() if t.family in LOCAL_FAMILIES}


def _build_local(settings: Settings) -> Provisioner:
    from provisioners.local import LocalProvisioner
    from provisioners.worker.agent import DEFAULT_MODELS

    profile = settings.data_dir / LOCAL_PROFILE_FILE
    try:
        return LocalProvisioner(
            state_dir=settings.data_dir / LOCAL_WORKERS_DIR,
            catalog_speed=local_speed_factors(default_catalog()),
            models=DEFAULT_MODELS,
            cache_dir=settings.data_dir / LOCAL_MODELS_DIR,
            profile=profile if profile.is_file() else None,
        )
    except InvalidConfigurationError as error:
        raise SettingsError(f"local.{error.field}", error.problem) from None


def provider_spot_prices(provisioner: Provisioner | None) -> SpotPricesFn | None:
    """What the planner is told spot costs now: the provider's prices where it reads them (the
    EC2 provisioner: ``DescribeSpotPriceHistory``, cached per type; the local and the fake one:
    the prices set on them), ``None`` for a provider that reads none. A type the provider has no
    price for is left to the catalog, as the reconciler's rule 10 leaves it; a read that fails
    (throttled, no permission) leaves every type to the catalog, with a warning."""
    if not isinstance(provisioner, SpotPriceSource):
        return None
    source = provisioner

    def prices(types: Sequence[str]) -> Mapping[str, float | None]:
        try:
            read = {t: source.spot_price(t) for t in types}
        except ProvisionerError as error:
            logger.warning("plan: spot prices not read (%s); the catalog's serve", error)
            return {}
        return {t: price for t, price in read.items() if price is not None}

    return prices


FACTORIES: dict[str, ProvisionerFactory] = {
    "ec2": _build_ec2,
    "fake": _build_fake,
    "local": _build_local,
}
