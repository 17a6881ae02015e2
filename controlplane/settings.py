"""The service's settings: where its data lives, which database and provisioner it uses, where it
listens, and how often its jobs run.

This module owns the schema (:class:`Settings`, with :class:`Ec2Settings` for the EC2
provisioner; pydantic-settings, since settings are a trust boundary) and how they are read
(:func:`load_settings`): environment variables ``HETEROPLANE_<FIELD>`` (nested fields with ``__``:
``HETEROPLANE_EC2__REGION``; lists and mappings as JSON; the EC2 fields also flat, as in
``HETEROPLANE_EC2_SUBNET_IDS=subnet-a,subnet-b`` and
``HETEROPLANE_EC2_LAUNCH_TEMPLATES=g4dn.xlarge=lt-1,c5.xlarge=lt-2``), over an optional YAML
config file (``load_settings(path)`` or ``$HETEROPLANE_CONFIG``; read by a source of our
own on pydantic-settings' public ``PydanticBaseSettingsSource``), over the defaults; arguments
to ``Settings(...)`` win over all of them. Every field, its variable and its default are
listed in ``docs/service.md``.

Every problem is one :class:`~controlplane.errors.SettingsError` naming the field (and the file):

>>> load_settings(Path("/nonexistent/heteroplane.yaml"))
Traceback (most recent call last):
...
controlplane.errors.SettingsError: /nonexistent/heteroplane.yaml: cannot read: No such file or \
directory
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, ClassVar, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)
from pydantic_settings import SettingsError as SourceError

from controlplane.errors import SettingsError, shown
from estimator.documents import UniqueKeyLoader

__all__ = [
    "CONFIG_ENV",
    "ENV_PREFIX",
    "Ec2Settings",
    "Settings",
    "SettingsError",
    "default_data_dir",
    "load_settings",
]

ENV_PREFIX = "HETEROPLANE_"
# The config file's path, when not given to load_settings (it is not itself a setting).
CONFIG_ENV = "HETEROPLANE_CONFIG"
DATABASE_FILE = "heteroplane.db"

# What a database URL may start with: SQLite (the embedded default) or PostgreSQL (psycopg 3; a
# plain postgresql:// URL is taken to mean psycopg 3, see controlplane.db.session).
_DATABASE_SCHEMES = ("sqlite://", "postgresql://", "postgresql+psycopg://")


def _refuse_bool_as_number(
    model: type[BaseModel], value: Any, info: ValidationInfo, prefix: str = ""
) -> Any:
    """``value`` unless it is ``true`` or ``false`` given for a numeric field of ``model``.

    pydantic's lax mode reads a boolean as 1 or 0: ``port: true`` in the config file served on
    port 1. The environment's text ``true`` is no number, and the app spec (strict) refuses a
    boolean as a number too; so does the config file (and ``Settings(...)``)."""
    if isinstance(value, bool) and info.field_name is not None:
        annotation = model.model_fields[info.field_name].annotation
        if annotation in (int, float):
            kind = "a whole number" if annotation is int else "a number"
            raise SettingsError(prefix + info.field_name, f"must be {kind}, got {shown(value)}")
    return value


def default_data_dir() -> Path:
    """``$XDG_DATA_HOME/heteroplane``, or ``~/.local/share/heteroplane`` (the XDG default)."""
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "share"
    return base / "heteroplane"


# An AWS resource id as EC2 writes them (subnet-0123abcd, sg-0123abcd): letters, digits and
# dashes, nothing a list's punctuation leaves behind.
_AWS_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]*")


class Ec2Settings(BaseModel):
    """Where and how the EC2 provisioner launches workers (needed when ``provisioner`` is ec2).

    Lists may also be given as comma-separated text (``subnet-a,subnet-b``) and
    ``launch_templates`` as ``type=id`` pairs (``g4dn.xlarge=lt-1,c5.xlarge=lt-2``), the form of
    the flat environment variables.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    region: str = Field(min_length=1, description="AWS region, e.g. us-east-1")
    subnet_ids: list[str] = Field(
        min_length=1, description="subnets to launch workers into, tried in order"
    )
    security_group_ids: list[str] = Field(description="security groups of the workers")
    ami_id: str | None = Field(
        default=None, min_length=1, description="image for types without a launch template"
    )
    launch_templates: dict[str, str] = Field(
        default_factory=dict, description="instance type -> launch template id (lt-...) or name"
    )
    tag_prefix: str = Field(
        default="heteroplane",
        min_length=1,
        pattern=r"^[^:]+$",
        description="prefix of the tags on our instances",
    )
    spot: bool = Field(
        default=False, description="spot capacity first (CreateFleet), on demand for the rest"
    )
    unavailable_ttl_s: float = Field(
        default=180.0,
        ge=0,
        allow_inf_nan=False,
        description="how long a (type, zone) out of capacity is skipped, s",
    )
    max_attempts: int = Field(
        default=5, ge=1, le=20, description="attempts per AWS call (botocore adaptive retries)"
    )
    endpoint_url: str | None = Field(
        default=None,
        description="EC2 endpoint override; prefer boto3's own AWS_ENDPOINT_URL (a moto server)",
    )
    interruption_queue_url: str | None = Field(
        default=None,
        min_length=1,
        description="SQS queue of spot interruption notices (the terraform module's"
        " interruption_queue_url output; none: interruptions are seen when the instance is gone)",
    )
    spot_price_ttl_s: float = Field(
        default=300.0,
        ge=0,
        allow_inf_nan=False,
        description="how long spot prices read from DescribeSpotPriceHistory are kept, s",
    )
    connect_timeout_s: float = Field(
        default=3.0,
        gt=0,
        allow_inf_nan=False,
        description="how long an EC2 or SQS call waits to connect, s (a hung endpoint fails it)",
    )
    read_timeout_s: float = Field(
        default=10.0,
        gt=0,
        allow_inf_nan=False,
        description="how long an EC2 or SQS call waits for its answer, s, per try (two at most)",
    )
    model_bucket: str | None = Field(
        default=None,
        min_length=3,
        max_length=63,
        pattern=r"^[a-z0-9][a-z0-9.-]+[a-z0-9]$",
        description="S3 bucket of the model registry's artifacts (none: the data directory)",
    )
    model_prefix: str = Field(
        default="models/",
        max_length=200,
        pattern=r"^([^/].*/)?$",
        description="key prefix of the artifacts in model_bucket (empty, or ending in '/')",
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_bool_as_number(cls, value, info, "ec2.")

    @field_validator("subnet_ids", "security_group_ids", mode="before")
    @classmethod
    def _split_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            if value.strip().startswith("["):
                # A JSON list, the form HETEROPLANE_EC2__SUBNET_IDS takes: split on its commas
                # it made the ids '["subnet-a"' and '"subnet-b"]', which only EC2 refused.
                try:
                    return json.loads(value)
                except ValueError:
                    raise ValueError("must be ids separated by commas, or a JSON list") from None
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("subnet_ids", "security_group_ids")
    @classmethod
    def _check_ids(cls, ids: list[str]) -> list[str]:
        for one in ids:
            if not _AWS_ID.fullmatch(one):
                raise ValueError(
                    f"must be AWS ids (subnet-0abc, sg-0abc) separated by commas: {one!r} is not"
                    " one"
                )
        return ids

    @field_validator("launch_templates", mode="before")
    @classmethod
    def _split_pairs(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        pairs: dict[str, str] = {}
        for part in (p.strip() for p in value.split(",")):
            if not part:
                continue
            instance_type, sep, template = (x.strip() for x in part.partition("="))
            if not sep or not instance_type or not template:
                raise SettingsError(
                    "ec2.launch_templates",
                    f"expected type=id pairs separated by commas, got {part!r}",
                )
            pairs[instance_type] = template
        return pairs

    @model_validator(mode="after")
    def _check_image(self) -> Ec2Settings:
        if not self.launch_templates and self.ami_id is None:
            raise SettingsError(
                "ec2.launch_templates",
                "must have at least 1 item when ec2.ami_id is not set (type=id pairs, or an AMI)",
            )
        return self


class Settings(BaseSettings):
    """The service's settings (see the module docstring for where they are read from)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
    )

    # The YAML file the config file source reads (a class's, not a setting: load_settings).
    config_file: ClassVar[Path | None] = None

    data_dir: Path = Field(
        default_factory=default_data_dir, description="where the service keeps its files"
    )
    database_url: str = Field(
        default="",
        description="SQLAlchemy URL; default sqlite:///{data_dir}/heteroplane.db; postgresql://"
        " or postgresql+psycopg:// selects PostgreSQL",
    )
    provisioner: Literal["local", "ec2", "fake"] = "local"
    host: str = Field(default="127.0.0.1", min_length=1)
    port: int = Field(default=8000, ge=1, le=65535)
    grpc_enabled: bool = Field(
        default=True,
        description="serve the Open Inference Protocol over gRPC next to the REST API",
    )
    grpc_port: int = Field(
        default=8001,
        ge=0,
        le=65535,
        description="port of the Open Inference Protocol over gRPC (on host); 0 picks a free one",
    )
    grpc_calls_max: int = Field(
        default=1000,
        ge=1,
        description="gRPC calls that take a token in flight at most (all connections); one more"
        " is RESOURCE_EXHAUSTED at once",
    )
    grpc_connections_max: int = Field(
        default=1000,
        ge=1,
        description="gRPC connections open at most (one more is closed as it is accepted); a"
        " connection's handshake must be done within http_head_timeout_s and one without a"
        " call for http_keep_alive_s is closed",
    )
    tuner_tick_s: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    gear_interval_s: float = Field(
        default=0.1,
        gt=0,
        allow_inf_nan=False,
        description="how often the gear switcher evaluates the gear of an app served by gears"
        " (CascadeServe's producer: 100 ms), s",
    )
    # The gear switcher's hysteresis (controlplane.policies.gears.Hysteresis; the defaults and
    # why: docs/gear-switching.md, "Hysteresis").
    gear_dead_band_share: float = Field(
        default=0.25,
        ge=0,
        lt=1,
        allow_inf_nan=False,
        description="the gear switches down only once the load falls below its range's low"
        " boundary x (1 - this share)",
    )
    gear_down_hold_s: float = Field(
        default=10.0,
        ge=0,
        allow_inf_nan=False,
        description="how long the load must stay below the dead band before the gear moves down, s",
    )
    gear_down_dwell_s: float = Field(
        default=30.0,
        ge=0,
        allow_inf_nan=False,
        description="the least time a cascade serves before a switch to a slower one, s",
    )
    gear_up_dwell_s: float = Field(
        default=5.0,
        ge=0,
        allow_inf_nan=False,
        description="the least time a cascade serves before a switch to a faster one, s",
    )
    # How long one plan (a preview, the capacity or the traffic replanner's) may run before it is
    # given up with a one-line reason (estimator.deadline).
    plan_deadline_s: float = Field(default=60.0, gt=0, le=3600, allow_inf_nan=False)
    tuner_max_window_s: float = Field(
        default=60.0,
        ge=1,
        allow_inf_nan=False,
        description="the tuner's longest envelope window and how far back it looks, s",
    )
    tuner_scale_down_delay_s: float = Field(
        default=15.0,
        ge=0,
        allow_inf_nan=False,
        description="the tuner's quiet time after a change before it scales down, s",
    )
    tuner_cascade_ladders: bool = Field(
        default=False,
        description=(
            "size a cascade's stages live by their sizing ladders (as heteroplane replay does)"
            " instead of InferLine's ratio per stage"
        ),
    )
    calibration_min_batches: int = Field(
        default=50,
        ge=1,
        description="observed batches of a (model, instance type) before calibration judges it",
    )
    calibration_threshold: float = Field(
        default=0.25,
        gt=0,
        allow_inf_nan=False,
        description="relative miss |observed / profile - 1| above which a profile is recalibrated",
    )
    calibration_fine_threshold: float = Field(
        # controlplane.policies.calibration.DEFAULT_FINE_THRESHOLD (which this layer cannot
        # import; a test keeps them equal): the miss that puts a queue at 90 % of its capacity
        # past a P99 15 % over the plan's.
        default=0.0145,
        gt=0,
        allow_inf_nan=False,
        description=(
            "a smaller relative miss corrected too when the evidence is sure of it (3 standard"
            " errors past it); the fleet is not re-sized for it; at the threshold or above: off"
        ),
    )
    calibration_fine_min_batches: int = Field(
        default=200,
        ge=1,
        description="observed batches of a (model, instance type) before a fine correction",
    )
    calibration_fine_persist_s: float = Field(
        default=60.0,
        ge=0,
        allow_inf_nan=False,
        description=(
            "how long after a fine verdict the calibration reads the factor on every tick"
            " before storing their mean (if still off by more than the fine threshold), s"
        ),
    )
    reconcile_s: float = Field(default=5.0, gt=0, allow_inf_nan=False)
    worker_unresponsive_s: float = Field(
        default=60.0,
        ge=0,
        allow_inf_nan=False,
        description=(
            "how long a running worker (local or EC2) past its boot may leave GET /health"
            " unanswered (three probes at least) before the reconciler replaces it, s;"
            " 0: workers are not probed"
        ),
    )
    worker_stuck_s: float = Field(
        default=600.0,
        gt=0,
        allow_inf_nan=False,
        description=(
            "how long a running worker's agent may say one batch has run (its /health busy_s)"
            " before the reconciler takes its model for stuck and replaces it, s (with"
            " worker_unresponsive_s > 0)"
        ),
    )
    capacity_replan_after_s: float = Field(
        default=60.0,
        ge=0,
        allow_inf_nan=False,
        description="how long a planned type may lack capacity before the app is re-planned, s",
    )
    replan_enabled: bool = Field(
        default=True,
        description="whether the replan job re-plans apps on their recorded traffic",
    )
    replan_s: float = Field(
        default=60.0,
        gt=0,
        allow_inf_nan=False,
        description="period of the replan job: each run checks the traffic since the last, s",
    )
    replan_window_s: float = Field(
        default=600.0,
        gt=0,
        allow_inf_nan=False,
        description="the most recorded traffic a re-plan plans on, s",
    )
    replan_hold_s: float = Field(
        default=300.0,
        ge=0,
        allow_inf_nan=False,
        description="how long every check must find the traffic out of the band to re-plan, s",
    )
    replan_above: float = Field(
        default=1.3,
        gt=1,
        allow_inf_nan=False,
        description="live / planned envelope ratio above which the traffic is out of the band",
    )
    replan_below: float = Field(
        default=0.6,
        gt=0,
        lt=1,
        allow_inf_nan=False,
        description="live / planned envelope ratio below which the traffic is out of the band",
    )
    replan_min_queries: int = Field(
        default=1_000,
        ge=2,
        description="recorded queries a re-plan needs at least",
    )
    rollup_s: float = Field(default=10.0, gt=0, allow_inf_nan=False)
    decision_retention_days: float = Field(
        default=30.0,
        gt=0,
        allow_inf_nan=False,
        description="the roll-up deletes decisions last made longer ago than this, days",
    )
    decision_retention_count: int = Field(
        default=10_000,
        ge=1,
        description="the roll-up keeps at most this many of an app's newest decisions",
    )
    instance_retention_days: float = Field(
        default=30.0,
        gt=0,
        allow_inf_nan=False,
        description="the roll-up deletes instances that ended longer ago than this, with their"
        " events, days",
    )
    disruption_max_instances: int = Field(
        default=1,
        ge=0,
        description="the disruption budget: serving instances of an app a plan or tuner shrink"
        " may drain per window, at least (the larger of this and the share counts)",
    )
    disruption_max_share: float = Field(
        default=0.25,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="the disruption budget: share of an app's serving fleet a plan or tuner"
        " shrink may drain per window (the larger of this and the count counts)",
    )
    disruption_window_s: float = Field(
        default=60.0,
        gt=0,
        allow_inf_nan=False,
        description="the disruption budget's window, s",
    )
    profile_run_heartbeat_s: float = Field(
        default=10.0,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="how often a profile run touches its workers' rows; the reconciler ends the"
        " workers of a run not heard of for four of these (its replica crashed), s",
    )
    spot_headroom_share: float = Field(
        default=0.1,
        ge=0,
        lt=1,
        allow_inf_nan=False,
        description="share of an app's budget below it at which a spot price rise starts moving"
        " the risen spot capacity to cheaper choices, so that the move comes before the budget"
        " is breached (docs/spot.md)",
    )
    spot_return_hold_s: float = Field(
        default=300.0,
        ge=0,
        allow_inf_nan=False,
        description="how long a spot price must stay at or below the type's on-demand price less"
        " spot_headroom_share of it before the instances a rise moved on demand go back to spot"
        " (so that a price that flaps does not flap the fleet; docs/spot.md), s",
    )
    spot_replan_move_share: float = Field(
        default=0.25,
        ge=0,
        allow_inf_nan=False,
        description="relative move of a spot price (from the prices the applied plan was made at)"
        " past which an app that buys spot is re-planned at the prices now; 0: never",
    )
    rollout_profile_run: bool = Field(
        default=True,
        description="a rollout's new version is profiled on the app's candidate types (a profile"
        " run's workers, within the budget, run by the rollout loop after the start answered)"
        " and the app planned again for it, each step's extra fleet sized from the new plan's"
        " stage fleet; false: from the applied plan's stage fleet",
    )
    serving_url: str | None = Field(
        default=None,
        description="the serving process's base URL, where a loops process running apart"
        " (heteroplane serve --role loops) reads what the serving loop observes",
    )
    internal_token: str | None = Field(
        default=None,
        repr=False,
        description="the secret a loops process running apart sends to the serving process's"
        " internal routes (an admin token, or any secret the serving process is given too: its"
        " internal routes take it); heteroplane serve makes one up for the loops it starts",
    )
    dispatch_url: str | None = Field(
        default=None,
        description="the base URL the other serving processes on the database reach this one"
        " at, to forward the queries of the apps it dispatches (default: the address it"
        " listens on, 127.0.0.1 for 0.0.0.0)",
    )
    loops_pull_s: float = Field(
        default=0.1,
        gt=0,
        allow_inf_nan=False,
        description="how often a loops process running apart exchanges the feed with the"
        " serving process (arrivals and statuses in, gears out), s",
    )
    model_max_bytes: int = Field(
        default=1 << 30,
        ge=1,
        description="the largest model artifact the registry takes (heteroplane model push), bytes",
    )
    serving_front_shed: bool = Field(
        default=True,
        description="past saturation, refuse a share of an app's inference queries as their"
        " head is read, before the API's work (429; the share follows admission control's"
        " refusals: docs/serving.md, Overload at the front); false: every query goes on to"
        " admission control",
    )
    http_head_timeout_s: float = Field(
        default=10.0,
        gt=0,
        allow_inf_nan=False,
        description="how long a request head may take to arrive whole (else 408 and the"
        " connection closed; a connection that sent nothing is closed), s",
    )
    http_keep_alive_s: float = Field(
        default=75.0,
        gt=0,
        allow_inf_nan=False,
        description="how long an idle kept-alive connection stays open between requests, s;"
        " longer than a load balancer's or client's idle timeout (the ALB's 60 s), so that the"
        " service never closes a connection the other side is about to send on",
    )
    http_head_max_bytes: int = Field(
        default=64 << 10,
        ge=8 << 10,
        description="the longest request head the HTTP server reads (longer: 431 and the"
        " connection closed), bytes",
    )
    http_body_min_rate_bytes_per_s: float = Field(
        default=1024.0,
        ge=0,
        allow_inf_nan=False,
        description="the slowest a request body may arrive, over each http_body_rate_window_s"
        " while the service is reading it (slower: 408 and the connection closed; 0: no"
        " minimum), bytes/s",
    )
    http_body_rate_window_s: float = Field(
        default=10.0,
        gt=0,
        allow_inf_nan=False,
        description="the window over which a body's arrival rate is measured, s",
    )
    http_unauthenticated_connections_max: int = Field(
        default=1000,
        ge=1,
        description="open connections that have not yet shown a valid token, at most; a new one"
        " past it closes the one of them idle or waiting longest",
    )
    oip_body_max_bytes: int = Field(
        default=64 << 20,
        ge=1 << 20,
        description="the ceiling on a /v2 inference body, bytes (the limit of an app is what"
        " 256 rows of its model's inputs take, up to this)",
    )
    ec2: Ec2Settings | None = None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Earlier sources win: arguments, then the environment (nested, then flat EC2
        # variables), then the config file (the class's config_file: none on this class, see
        # load_settings); nested mappings are merged across them. No .env file and no secrets
        # directory: the service reads nothing it was not pointed at.
        return (
            init_settings,
            env_settings,
            _FlatEc2Source(settings_cls),
            _ConfigFileSource(settings_cls),
        )

    @model_validator(mode="before")
    @classmethod
    def _default_database_url(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("database_url"):
            return data
        raw_dir = data.get("data_dir")
        if raw_dir is None:
            data_dir = default_data_dir()
        elif isinstance(raw_dir, str | os.PathLike):
            data_dir = Path(raw_dir).expanduser()
        else:
            return data  # data_dir's own check reports it
        return {**data, "database_url": f"sqlite:///{data_dir / DATABASE_FILE}"}

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_bool_as_number(cls, value, info)

    @field_validator("data_dir", mode="before")
    @classmethod
    def _check_data_dir(cls, value: Any) -> Any:
        # Path("") is ".": HETEROPLANE_DATA_DIR="" kept the database in the working directory
        # without a word (an empty host is refused the same way). A ValueError, not a
        # SettingsError: the message then names the variable it came from.
        if isinstance(value, str) and not value.strip():
            raise ValueError("must not be empty (a directory path)")
        return value

    @field_validator("data_dir")
    @classmethod
    def _expand_data_dir(cls, value: Path) -> Path:
        return value.expanduser()

    @field_validator("database_url")
    @classmethod
    def _check_database_url(cls, value: str) -> str:
        if not value.startswith(_DATABASE_SCHEMES):
            scheme = value.split("://", 1)[0] if "://" in value else value
            raise SettingsError(
                "database_url",
                f"unsupported database {scheme!r}; use sqlite:///PATH or"
                " postgresql://USER:PASSWORD@HOST/DB",
            )
        return value

    @field_validator("serving_url", "dispatch_url")
    @classmethod
    def _check_base_url(cls, value: str | None, info: ValidationInfo) -> str | None:
        """A base URL another process calls: ``http(s)://HOST[:PORT]``, no path (the routes are
        put after it: ``http://h:8000/v1`` read ``/v1/internal/v1/feed``, a 404 on every
        round), no query. A trailing ``/`` is dropped."""
        if value is None:
            return None
        field = info.field_name or "url"
        parts = urlsplit(value.strip())
        try:
            port = parts.port
        except ValueError:
            port = -1
        if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
            raise SettingsError(field, f"must be http://HOST:PORT (or https://), got {value!r}")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise SettingsError(
                field, f"must be a base URL, http://HOST:PORT without a path, got {value!r}"
            )
        return f"{parts.scheme}://{parts.netloc}"

    @model_validator(mode="after")
    def _check_provisioner(self) -> Settings:
        if self.provisioner == "ec2" and self.ec2 is None:
            raise SettingsError(
                "ec2",
                "is required when provisioner is 'ec2' (region, subnet_ids, security_group_ids,"
                " launch_templates or ami_id)",
            )
        return self

    @property
    def is_postgresql(self) -> bool:
        return self.database_url.startswith("postgresql")

    def ensure_data_dir(self) -> Path:
        """Create :attr:`data_dir` (and its parents) if missing; return it."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        return self.data_dir


class _FlatEc2Source(PydanticBaseSettingsSource):
    """``HETEROPLANE_EC2_<FIELD>`` (one underscore, the issue's contract) for each field of
    :class:`Ec2Settings`, as ``{"ec2": {...}}``; the values stay text for its validators."""

    _PREFIX = f"{ENV_PREFIX}EC2_"

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ reads the whole group at once

    def __call__(self) -> dict[str, Any]:
        values = {
            name: os.environ[self._PREFIX + name.upper()]
            for name in Ec2Settings.model_fields
            if self._PREFIX + name.upper() in os.environ
        }
        return {"ec2": values} if values else {}


class _ConfigFileSource(PydanticBaseSettingsSource):
    """The YAML config file named by the class's ``config_file`` (none: no settings), read
    whether or not it exists, with one-line errors naming the file (a missing file, bad YAML, a
    document that is not a mapping) and a relative ``data_dir`` taken beside the file.

    Built on pydantic-settings' public source base (``get_field_value`` and ``__call__``, as
    :class:`_FlatEc2Source`), not on its ``YamlConfigSettingsSource``, whose reading is done
    by private methods this class would have to override."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ reads the whole file at once

    def __call__(self) -> dict[str, Any]:
        file: Path | None = getattr(self.settings_cls, "config_file", None)
        return {} if file is None else self._read(file)

    def _read(self, file_path: Any) -> dict[str, Any]:
        path = Path(file_path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as error:
            raise SettingsError("", f"cannot read: {error.strerror or error}", str(path)) from None
        except UnicodeDecodeError:
            raise SettingsError("", "not UTF-8 text (expected YAML)", str(path)) from None
        try:
            document = yaml.load(text, Loader=UniqueKeyLoader)  # a SafeLoader subclass
        except RecursionError:
            raise SettingsError("", "YAML nested too deeply to read", str(path)) from None
        except yaml.constructor.ConstructorError as error:
            # A key given twice (the last would win without a word), an unhashable key.
            mark = error.problem_mark
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise SettingsError("", f"not valid YAML{where}: {error.problem}", str(path)) from None
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise SettingsError("", f"not valid YAML{where}", str(path)) from None
        if document is None:
            return {}
        if not isinstance(document, dict):
            raise SettingsError(
                "", f"must be a mapping of settings, got {type(document).__name__}", str(path)
            )
        for key in document:
            if not isinstance(key, str):  # `1: x`; a name is always text
                raise SettingsError(str(key), "unknown setting", str(path))
        group = document.get("ec2")
        if group is not None and not isinstance(group, dict):
            # Checked here: merged with HETEROPLANE_EC2_* values, a group that is not a mapping
            # was dropped without a word.
            raise SettingsError(
                "ec2", f"must be a mapping of EC2 settings, got {shown(group)}", str(path)
            )
        data_dir = document.get("data_dir")
        if (
            isinstance(data_dir, str)
            and data_dir.strip()  # an empty one is refused by its own check, not put beside
            and not Path(data_dir).expanduser().is_absolute()
        ):
            # A relative data_dir in a config file means beside the file, not the working
            # directory.
            document = {**document, "data_dir": str(path.parent / data_dir)}
        database_url = document.get("database_url")
        if isinstance(database_url, str):
            document = {**document, "database_url": _sqlite_beside(database_url, path.parent)}
        return document


# A SQLite URL's scheme and its path (``sqlite:///PATH``, ``sqlite+pysqlite:///PATH``), then an
# optional query.
_SQLITE_URL = re.compile(r"(?P<scheme>sqlite(?:\+\w+)?:///)(?P<path>[^?]*)(?P<query>\?.*)?", re.S)


def _sqlite_beside(url: str, folder: Path) -> str:
    """``url`` with a relative SQLite file path taken beside the config file's ``folder``, as a
    relative ``data_dir`` is: read against the working directory, the same file named another
    database for each directory a command was run from (a token made by ``token create
    --config`` from one was unknown to the service started from another). Absolute paths,
    ``~`` paths, in-memory databases and other URLs are left as they are."""
    match = _SQLITE_URL.fullmatch(url)
    if match is None:
        return url
    database = match["path"]
    if (
        not database.strip()
        or database == ":memory:"
        or database.startswith(("file:", "~"))
        or Path(database).is_absolute()
    ):
        return url
    return f"{match['scheme']}{folder / database}{match['query'] or ''}"


def load_settings(config_file: Path | None = None) -> Settings:
    """The settings from the environment over the YAML ``config_file`` (or ``$HETEROPLANE_CONFIG``
    when none is given; no file when neither) over the defaults.

    Raises :class:`SettingsError` (one line, naming the field or the file) on any problem.
    """
    if config_file is None and os.environ.get(CONFIG_ENV):
        config_file = Path(os.environ[CONFIG_ENV])
    settings_cls = Settings if config_file is None else _reading(config_file)
    source = None if config_file is None else str(config_file)
    try:
        return settings_cls()
    except SettingsError as error:
        raise SettingsError(error.field, error.problem, error.source or source) from None
    except ValidationError as error:
        raise _settings_error_from(error, source) from None
    except SourceError as error:
        # pydantic-settings' own, for a nested variable of a list or mapping that is not JSON
        # (HETEROPLANE_EC2__SUBNET_IDS=a,b): it was a traceback out of every command.
        raise _nested_environment_error(error) from None


# The flat and the nested (JSON) forms of the EC2 settings that are a list or a mapping.
_EC2_COMPLEX = {
    "subnet_ids": ('["subnet-a","subnet-b"]', "subnet-a,subnet-b"),
    "security_group_ids": ('["sg-1","sg-2"]', "sg-1,sg-2"),
    "launch_templates": ('{"g4dn.xlarge":"lt-0123"}', "g4dn.xlarge=lt-0123"),
}


def _nested_environment_error(error: SourceError) -> SettingsError:
    """One line for a ``HETEROPLANE_EC2__<FIELD>`` variable that pydantic-settings could not
    parse as JSON: the variable, its value, and both forms that work."""
    prefix = f"{ENV_PREFIX}EC2__"
    for name in sorted(os.environ):
        field = name[len(prefix) :].lower() if name.upper().startswith(prefix) else None
        if field not in _EC2_COMPLEX:
            continue
        value = os.environ[name]
        try:
            json.loads(value)
        except ValueError:
            nested, flat = _EC2_COMPLEX[field]
            return SettingsError(
                f"ec2.{field}",
                f"must be JSON in this nested form ({nested}), or use"
                f" {ENV_PREFIX}EC2_{field.upper()}={flat}, got {shown(value)} ({name})",
            )
    return SettingsError("", " ".join(str(error).split()))


def _reading(config_file: Path) -> type[Settings]:
    """:class:`Settings` whose config file source reads ``config_file``.

    pydantic-settings builds a model's sources from its class, never from an instance
    (pydantic/pydantic-settings#259), so a file named at run time (``--config``) is a subclass
    that names it and adds nothing else: no field, no validator.
    """
    path = config_file

    class FileSettings(Settings):
        config_file: ClassVar[Path | None] = path

    return FileSettings


def _settings_error_from(error: ValidationError, source: str | None) -> SettingsError:
    details = error.errors(include_url=False)
    # An unknown field first: a misspelt key is the useful thing to point at.
    detail = next((d for d in details if d["type"] == "extra_forbidden"), details[0])
    context: dict[str, Any] = detail.get("ctx") or {}
    cause = context.get("error")
    if isinstance(cause, SettingsError):
        return SettingsError(cause.field, cause.problem, source)
    loc = [str(part) for part in detail["loc"]]
    # A union's loc carries the member's class name (ec2.Ec2Settings.region): drop it.
    loc = [part for part in loc if part != Ec2Settings.__name__]
    field = ".".join(loc)
    if detail["type"] == "missing":
        problem = "is required"
    elif detail["type"] == "extra_forbidden":
        problem = "unknown setting"
    else:
        # pydantic says "Input should be ...", "List should have ...": say "must".
        message = re.sub(r"^\w+ should ", "must ", str(detail["msg"]).removeprefix("Value error, "))
        # "must be a valid integer, got a number with a fractional part": the value once, and
        # pydantic's word on it after it.
        head, got, what = message.partition(", got ")
        problem = f"{head}, got {shown(detail.get('input'))}" + (f" ({what})" if got else "")
    env = ENV_PREFIX + "__".join(part.upper() for part in loc) if loc else ""
    flat = ENV_PREFIX + "_".join(part.upper() for part in loc)
    if len(loc) == 2 and loc[0] == "ec2" and env not in os.environ and flat in os.environ:
        env = flat  # the value came from the flat form, HETEROPLANE_EC2_<FIELD>
    if env and env in os.environ and detail["type"] != "extra_forbidden":
        # Named only where the value came from it: the same field may have come from the file.
        problem += f" ({env})"
    return SettingsError(field, problem, source)
