"""The service's settings: where its data lives, which database and provisioner it uses, where it
listens, and how often its jobs run.

This module owns the schema (:class:`Settings`, with :class:`Ec2Settings` for the EC2
provisioner; pydantic-settings, since settings are a trust boundary) and how they are read
(:func:`load_settings`): environment variables ``HETEROPLANE_<FIELD>`` (nested fields with ``__``:
``HETEROPLANE_EC2__REGION``; lists and mappings as JSON), over an optional YAML config file
(``load_settings(path)`` or ``$HETEROPLANE_CONFIG``), over the defaults. Every field, its variable
and its default are listed in ``docs/service.md``.

Every problem is one :class:`~controlplane.errors.SettingsError` naming the field:

>>> load_settings_from({"port": 70000})
Traceback (most recent call last):
...
controlplane.errors.SettingsError: port: must be less than or equal to 65535, got 70000 \
(HETEROPLANE_PORT)
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from controlplane.errors import SettingsError

__all__ = [
    "CONFIG_ENV",
    "ENV_PREFIX",
    "Ec2Settings",
    "Settings",
    "SettingsError",
    "default_data_dir",
    "load_settings",
    "load_settings_from",
]

ENV_PREFIX = "HETEROPLANE_"
# The config file's path, when not given to load_settings (it is not itself a setting).
CONFIG_ENV = "HETEROPLANE_CONFIG"
DATABASE_FILE = "heteroplane.db"

# What a database URL may start with: SQLite (the embedded default) or PostgreSQL (psycopg 3; a
# plain postgresql:// URL is taken to mean psycopg 3, see controlplane.db.session).
_DATABASE_SCHEMES = ("sqlite://", "postgresql://", "postgresql+psycopg://")

# The values of the config file being read, for the one source that reads them (set only inside
# load_settings; a plain Settings() reads the environment and the defaults).
_FILE_VALUES: ContextVar[Mapping[str, Any] | None] = ContextVar("_FILE_VALUES", default=None)


def default_data_dir() -> Path:
    """``$XDG_DATA_HOME/heteroplane``, or ``~/.local/share/heteroplane`` (the XDG default)."""
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "share"
    return base / "heteroplane"


class Ec2Settings(BaseModel):
    """Where and how the EC2 provisioner launches workers (needed when ``provisioner`` is ec2)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    region: str = Field(min_length=1, description="AWS region, e.g. us-east-1")
    subnet_ids: list[str] = Field(min_length=1, description="subnets to launch workers into")
    security_group_ids: list[str] = Field(description="security groups of the workers")
    launch_templates: dict[str, str] = Field(
        min_length=1, description="instance type -> launch template id (lt-...) or name"
    )
    tag_prefix: str = Field(
        default="heteroplane", min_length=1, description="prefix of the tags on our instances"
    )
    endpoint_url: str | None = Field(
        default=None, description="EC2 endpoint override (a moto server in tests)"
    )


class Settings(BaseSettings):
    """The service's settings (see the module docstring for where they are read from)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
    )

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
    tuner_tick_s: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    reconcile_s: float = Field(default=5.0, gt=0, allow_inf_nan=False)
    rollup_s: float = Field(default=10.0, gt=0, allow_inf_nan=False)
    replan_h: float = Field(default=6.0, gt=0, allow_inf_nan=False)
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
        # Earlier sources win: arguments, then the environment, then the config file. No .env
        # file and no secrets directory: the service reads nothing it was not pointed at.
        file_settings = InitSettingsSource(settings_cls, init_kwargs=dict(_FILE_VALUES.get() or {}))
        return init_settings, env_settings, file_settings

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

    @model_validator(mode="after")
    def _check_provisioner(self) -> Settings:
        if self.provisioner == "ec2" and self.ec2 is None:
            raise SettingsError(
                "ec2",
                "is required when provisioner is 'ec2' (region, subnet_ids, security_group_ids,"
                " launch_templates)",
            )
        return self

    @property
    def is_postgresql(self) -> bool:
        return self.database_url.startswith("postgresql")

    def ensure_data_dir(self) -> Path:
        """Create :attr:`data_dir` (and its parents) if missing; return it."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        return self.data_dir


def load_settings(config_file: Path | None = None) -> Settings:
    """The settings from the environment over the YAML ``config_file`` (or ``$HETEROPLANE_CONFIG``
    when none is given; no file when neither) over the defaults.

    Raises :class:`SettingsError` (one line, naming the field or the file) on any problem.
    """
    if config_file is None and os.environ.get(CONFIG_ENV):
        config_file = Path(os.environ[CONFIG_ENV])
    values: Mapping[str, Any] = {}
    source = None
    if config_file is not None:
        source = str(config_file)
        values = _read_config_file(config_file)
    return load_settings_from(values, source)


def load_settings_from(values: Mapping[str, Any], source: str | None = None) -> Settings:
    """The settings from the environment over ``values`` (a config file's content, already read)
    over the defaults; ``source`` names the file in error messages."""
    with _file_values(values):
        try:
            return Settings()
        except SettingsError as error:
            raise SettingsError(error.field, error.problem, source) from None
        except ValidationError as error:
            raise _settings_error_from(error, source) from None


@contextmanager
def _file_values(values: Mapping[str, Any]) -> Iterator[None]:
    token = _FILE_VALUES.set(values)
    try:
        yield
    finally:
        _FILE_VALUES.reset(token)


def _read_config_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise SettingsError("", f"cannot read: {error.strerror or error}", str(path)) from None
    try:
        document = yaml.safe_load(text)
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
    data_dir = document.get("data_dir")
    if isinstance(data_dir, str) and not Path(data_dir).expanduser().is_absolute():
        # A relative data_dir in a config file means beside the file, not the working directory.
        document = {**document, "data_dir": str(path.parent / data_dir)}
    return document


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
        problem = f"{message}, got {_shown(detail.get('input'))}"
    env = ENV_PREFIX + "__".join(part.upper() for part in loc) if loc else ""
    if env and detail["type"] != "extra_forbidden":
        problem += f" ({env})"
    return SettingsError(field, problem, source)


def _shown(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 60 else text[:57] + "..."
