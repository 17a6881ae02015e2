"""Settings: defaults, the environment over the config file, one-line errors naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from controlplane.errors import SettingsError
from controlplane.settings import Ec2Settings, Settings, load_settings

EC2_YAML = """
provisioner: ec2
ec2:
  region: us-east-1
  subnet_ids: [subnet-1]
  security_group_ids: [sg-1]
  launch_templates: {g4dn.xlarge: lt-0123}
"""


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    import os

    for name in list(os.environ):
        if name.startswith("HETEROPLANE_"):
            monkeypatch.delenv(name)
    xdg = tmp_path / "xdg"
    monkeypatch.setenv("XDG_DATA_HOME", str(xdg))
    return xdg


def write(tmp_path: Path, text: str, name: str = "heteroplane.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults(clean_environment: Path) -> None:
    settings = load_settings()
    assert settings.data_dir == clean_environment / "heteroplane"
    assert settings.database_url == f"sqlite:///{clean_environment}/heteroplane/heteroplane.db"
    assert settings.provisioner == "local"
    assert (settings.host, settings.port) == ("127.0.0.1", 8000)
    assert (settings.tuner_tick_s, settings.reconcile_s, settings.rollup_s) == (1.0, 5.0, 10.0)
    assert (settings.decision_retention_days, settings.decision_retention_count) == (30.0, 10_000)
    assert settings.instance_retention_days == 30.0
    assert settings.ec2 is None
    assert not settings.is_postgresql


def test_data_dir_defaults_to_local_share_without_xdg(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert load_settings().data_dir == tmp_path / ".local" / "share" / "heteroplane"


def test_environment_sets_fields_and_database_follows_data_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HETEROPLANE_PORT", "9001")
    monkeypatch.setenv("HETEROPLANE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("HETEROPLANE_RECONCILE_S", "2.5")
    settings = load_settings()
    assert settings.port == 9001
    assert settings.reconcile_s == 2.5
    assert settings.database_url == f"sqlite:///{tmp_path}/data/heteroplane.db"


def test_postgresql_url(monkeypatch: pytest.MonkeyPatch) -> None:
    for url in ("postgresql://u:p@db/heteroplane", "postgresql+psycopg://u@db/heteroplane"):
        monkeypatch.setenv("HETEROPLANE_DATABASE_URL", url)
        settings = load_settings()
        assert settings.database_url == url
        assert settings.is_postgresql


def test_config_file_under_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = write(tmp_path, "port: 7000\nhost: 0.0.0.0\nrollup_s: 30\n")
    monkeypatch.setenv("HETEROPLANE_PORT", "7100")
    settings = load_settings(path)
    assert isinstance(settings, Settings)
    assert settings.port == 7100  # the environment wins
    assert settings.host == "0.0.0.0"
    assert settings.rollup_s == 30.0


def test_config_file_from_environment_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HETEROPLANE_CONFIG", str(write(tmp_path, "provisioner: fake\n")))
    assert load_settings().provisioner == "fake"


def test_relative_data_dir_in_file_is_beside_the_file(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, "data_dir: state\n"))
    assert settings.data_dir == tmp_path / "state"
    assert settings.database_url == f"sqlite:///{tmp_path}/state/heteroplane.db"


def test_relative_sqlite_database_in_file_is_beside_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read against the working directory, one config file named another database for each
    directory a command ran from: a token made by token create --config in one was unknown to
    the service started from another."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = write(tmp_path, "database_url: sqlite:///db/hp.db?timeout=5\n")
    assert load_settings(config).database_url == f"sqlite:///{tmp_path}/db/hp.db?timeout=5"
    for url in (
        f"sqlite:///{tmp_path}/abs.db",
        "sqlite:///:memory:",
        "sqlite://",
        "sqlite:///~/hp.db",
        "postgresql://u:p@h/db",
    ):
        assert load_settings(write(tmp_path, f"database_url: '{url}'\n")).database_url == url
    # In the environment, a relative path stays the working directory's, as a relative
    # HETEROPLANE_DATA_DIR does.
    monkeypatch.setenv("HETEROPLANE_DATABASE_URL", "sqlite:///hp.db")
    assert load_settings(config).database_url == "sqlite:///hp.db"


def test_ec2_settings_from_file_and_nested_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HETEROPLANE_EC2__REGION", "eu-west-1")
    monkeypatch.setenv("HETEROPLANE_EC2__ENDPOINT_URL", "http://127.0.0.1:5000")
    settings = load_settings(write(tmp_path, EC2_YAML))
    assert settings.ec2 is not None
    assert settings.ec2.region == "eu-west-1"
    assert settings.ec2.endpoint_url == "http://127.0.0.1:5000"
    assert settings.ec2.subnet_ids == ["subnet-1"]
    assert settings.ec2.launch_templates == {"g4dn.xlarge": "lt-0123"}
    assert settings.ec2.tag_prefix == "heteroplane"


def test_ensure_data_dir_creates_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETEROPLANE_DATA_DIR", str(tmp_path / "a" / "b"))
    settings = load_settings()
    assert settings.ensure_data_dir() == tmp_path / "a" / "b"
    assert (tmp_path / "a" / "b").is_dir()


def test_settings_are_frozen() -> None:
    settings = load_settings()
    with pytest.raises(ValidationError):
        settings.port = 1  # type: ignore[misc]


def test_settings_accepts_arguments_and_they_win_over_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert Settings(port=1234).port == 1234
    monkeypatch.setenv("HETEROPLANE_PORT", "7100")
    assert Settings(port=1234).port == 1234
    assert Settings().port == 7100


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("HETEROPLANE_PORT", "0", "port: must be greater than or equal to 1"),
        ("HETEROPLANE_PORT", "70000", "port: must be less than or equal to 65535"),
        ("HETEROPLANE_PORT", "http", "port: must be a valid integer"),
        ("HETEROPLANE_TUNER_TICK_S", "0", "tuner_tick_s: must be greater than 0"),
        ("HETEROPLANE_ROLLUP_S", "nan", "rollup_s: must be a finite number"),
        (
            "HETEROPLANE_DECISION_RETENTION_DAYS",
            "0",
            "decision_retention_days: must be greater than 0",
        ),
        (
            "HETEROPLANE_DECISION_RETENTION_COUNT",
            "0",
            "decision_retention_count: must be greater than or equal to 1",
        ),
        ("HETEROPLANE_PROVISIONER", "gcp", "provisioner: must be 'local', 'ec2' or 'fake'"),
        ("HETEROPLANE_PROVISIONER", "ec2", "ec2: is required when provisioner is 'ec2'"),
        ("HETEROPLANE_DATABASE_URL", "mysql://x/y", "database_url: unsupported database 'mysql'"),
        ("HETEROPLANE_EC2__REGION", "us-east-1", "ec2.subnet_ids: is required"),
        ("HETEROPLANE_SERVING_URL", "127.0.0.1:8000", "serving_url: must be http://HOST:PORT"),
        ("HETEROPLANE_SERVING_URL", "http://h:8000/v1", "serving_url: must be a base URL"),
        ("HETEROPLANE_DISPATCH_URL", "http://h:99999", "dispatch_url: must be http://HOST:PORT"),
        # Taken as the working directory (the database sqlite:///heteroplane.db) without a word.
        ("HETEROPLANE_DATA_DIR", "", "data_dir: must not be empty (a directory path), got ''"),
        ("HETEROPLANE_DATA_DIR", " ", "data_dir: must not be empty (a directory path), got ' '"),
    ],
)
def test_bad_environment_is_one_line_naming_the_field(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, message: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError) as caught:
        load_settings()
    assert str(caught.value).startswith(message)
    assert "\n" not in str(caught.value)
    assert caught.value.field == message.split(":")[0]


def test_message_names_the_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETEROPLANE_PORT", "70000")
    with pytest.raises(SettingsError, match=r"\(HETEROPLANE_PORT\)"):
        load_settings()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("prot: 8000\n", "prot: unknown setting"),
        (
            "ec2: {region: x, subnet_ids: [s], security_group_ids: [], launch_templates: {}}\n",
            "ec2.launch_templates: must have at least 1 item",
        ),
        ("port: [\n", "not valid YAML at line"),
        ("- port\n", "must be a mapping of settings, got list"),
        ("1: 8000\n", "1: unknown setting"),
        ("tuner_tick_s: -3\n", "tuner_tick_s: must be greater than 0"),
        # It said "got" twice: "..., got a number with a fractional part, got 8000.5".
        (
            "port: 8000.5\n",
            "port: must be a valid integer, got 8000.5 (a number with a fractional part)",
        ),
        # Taken as the config file's folder without a word.
        ('data_dir: ""\n', "data_dir: must not be empty (a directory path), got ''"),
        # The last one was kept without a word.
        ("port: 8001\nport: 8002\n", "not valid YAML at line 2: key 'port' appears twice"),
    ],
)
def test_bad_config_file_names_file_and_field(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(SettingsError) as caught:
        load_settings(path)
    assert str(caught.value).startswith(f"{path}: ")
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_an_ec2_group_that_is_not_a_mapping_is_refused_beside_the_flat_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Merged with HETEROPLANE_EC2_* values, ``ec2: 5`` in the file was dropped silently."""
    monkeypatch.setenv("HETEROPLANE_EC2_REGION", "us-east-1")
    path = write(tmp_path, "ec2: 5\n")
    with pytest.raises(SettingsError) as caught:
        load_settings(path)
    assert str(caught.value) == f"{path}: ec2: must be a mapping of EC2 settings, got 5"


def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    """It was a UnicodeDecodeError's traceback."""
    path = tmp_path / "bin.yaml"
    path.write_bytes(b"\xff\xfe\x00a")
    with pytest.raises(SettingsError) as caught:
        load_settings(path)
    assert str(caught.value) == f"{path}: not UTF-8 text (expected YAML)"


def test_a_bad_value_from_the_file_names_no_environment_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The variable is named where the value came from it, not from the file."""
    monkeypatch.delenv("HETEROPLANE_PORT", raising=False)
    path = write(tmp_path, "port: abc\n")
    with pytest.raises(SettingsError) as caught:
        load_settings(path)
    assert "port: must be a valid integer" in str(caught.value)
    assert "HETEROPLANE_PORT" not in str(caught.value)


def _typed(model: type[BaseModel], *types: type) -> list[str]:
    return [name for name, field in model.model_fields.items() if field.annotation in types]


@pytest.mark.parametrize("value", ["true", "false"])
@pytest.mark.parametrize(
    "key", _typed(Settings, int, float) + [f"ec2.{n}" for n in _typed(Ec2Settings, int, float)]
)
def test_a_boolean_in_the_file_is_no_number(tmp_path: Path, key: str, value: str) -> None:
    """``port: true`` served on port 1, ``tuner_tick_s: true`` ticked every 1.0 s (pydantic
    reads a boolean as 1 or 0); HETEROPLANE_PORT=true and the app spec refuse it."""
    field = key.removeprefix("ec2.")
    if key.startswith("ec2."):
        text = EC2_YAML + f"  {field}: {value}\n"
        kind = Ec2Settings.model_fields[field].annotation
    else:
        text = f"{key}: {value}\n"
        kind = Settings.model_fields[key].annotation
    path = write(tmp_path, text)
    with pytest.raises(SettingsError) as caught:
        load_settings(path)
    number = "a whole number" if kind is int else "a number"
    assert str(caught.value) == f"{path}: {key}: must be {number}, got {value.title()}"
    assert caught.value.field == key


def test_a_boolean_setting_still_takes_true_and_false(tmp_path: Path) -> None:
    flags = _typed(Settings, bool)
    assert "grpc_enabled" in flags and "replan_enabled" in flags
    for value in (True, False):
        lines = [f"{name}: {str(value).lower()}" for name in flags]
        text = "\n".join(lines) + "\n" + EC2_YAML + f"  spot: {str(value).lower()}\n"
        settings = load_settings(write(tmp_path, text))
        assert all(getattr(settings, name) is value for name in flags)
        assert settings.ec2 is not None and settings.ec2.spot is value


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="cannot read: No such file"):
        load_settings(tmp_path / "nope.yaml")


def test_empty_config_file_is_the_defaults(tmp_path: Path) -> None:
    assert load_settings(write(tmp_path, "")).port == 8000


def test_settings_error_is_a_value_error() -> None:
    assert issubclass(SettingsError, ValueError)


FLAT_EC2 = {
    "HETEROPLANE_PROVISIONER": "ec2",
    "HETEROPLANE_EC2_REGION": "us-west-2",
    "HETEROPLANE_EC2_SUBNET_IDS": "subnet-a, subnet-b",
    "HETEROPLANE_EC2_SECURITY_GROUP_IDS": "sg-1,sg-2",
    "HETEROPLANE_EC2_LAUNCH_TEMPLATES": "g4dn.xlarge=lt-0123, c5.xlarge=heteroplane-c5.xlarge",
}


def test_flat_ec2_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in FLAT_EC2.items():
        monkeypatch.setenv(name, value)
    settings = load_settings()
    assert settings.provisioner == "ec2"
    assert settings.ec2 is not None
    assert settings.ec2.region == "us-west-2"
    assert settings.ec2.subnet_ids == ["subnet-a", "subnet-b"]
    assert settings.ec2.security_group_ids == ["sg-1", "sg-2"]
    assert settings.ec2.launch_templates == {
        "g4dn.xlarge": "lt-0123",
        "c5.xlarge": "heteroplane-c5.xlarge",
    }
    assert settings.ec2.ami_id is None
    assert (settings.ec2.spot, settings.ec2.unavailable_ttl_s, settings.ec2.max_attempts) == (
        False,
        180.0,
        5,
    )


def test_flat_ec2_environment_with_an_ami_and_no_templates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETEROPLANE_EC2_REGION", "us-east-1")
    monkeypatch.setenv("HETEROPLANE_EC2_SUBNET_IDS", "subnet-a")
    monkeypatch.setenv("HETEROPLANE_EC2_SECURITY_GROUP_IDS", "")
    monkeypatch.setenv("HETEROPLANE_EC2_AMI_ID", "ami-0abc")
    monkeypatch.setenv("HETEROPLANE_EC2_SPOT", "true")
    settings = load_settings()
    assert settings.ec2 is not None
    assert settings.ec2.ami_id == "ami-0abc"
    assert settings.ec2.launch_templates == {}
    assert settings.ec2.security_group_ids == []
    assert settings.ec2.spot


def test_flat_ec2_environment_merges_with_the_file_and_nested_form_wins(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HETEROPLANE_EC2_REGION", "eu-west-1")
    monkeypatch.setenv("HETEROPLANE_EC2_SUBNET_IDS", "subnet-flat")
    monkeypatch.setenv("HETEROPLANE_EC2__SUBNET_IDS", '["subnet-nested"]')
    settings = load_settings(write(tmp_path, EC2_YAML))
    assert settings.ec2 is not None
    assert settings.ec2.region == "eu-west-1"
    assert settings.ec2.subnet_ids == ["subnet-nested"]
    assert settings.ec2.launch_templates == {"g4dn.xlarge": "lt-0123"}


def test_a_flat_list_of_ids_may_be_json(monkeypatch: pytest.MonkeyPatch) -> None:
    """The form HETEROPLANE_EC2__SUBNET_IDS takes: split on its commas, it made the ids
    '["subnet-a"' and '"subnet-b"]', which only EC2 refused, at the first launch."""
    for name, good in FLAT_EC2.items():
        monkeypatch.setenv(name, good)
    monkeypatch.setenv("HETEROPLANE_EC2_SUBNET_IDS", '["subnet-a", "subnet-b"]')
    settings = load_settings()
    assert settings.ec2 is not None and settings.ec2.subnet_ids == ["subnet-a", "subnet-b"]


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        (
            "HETEROPLANE_EC2_LAUNCH_TEMPLATES",
            "g4dn.xlarge",
            "ec2.launch_templates: expected type=id",
        ),
        ("HETEROPLANE_EC2_LAUNCH_TEMPLATES", "", "ec2.launch_templates: must have at least 1 item"),
        ("HETEROPLANE_EC2_SUBNET_IDS", " , ", "ec2.subnet_ids: must have at least 1 item"),
        ("HETEROPLANE_EC2_MAX_ATTEMPTS", "0", "ec2.max_attempts: must be greater than or equal"),
        ("HETEROPLANE_EC2_TAG_PREFIX", "a:b", "ec2.tag_prefix: must match pattern"),
        # Not a list of ids: these were kept as ids ('subnet-a;subnet-b'), for EC2 to refuse.
        (
            "HETEROPLANE_EC2_SUBNET_IDS",
            "subnet-a;subnet-b",
            "ec2.subnet_ids: must be AWS ids (subnet-0abc, sg-0abc) separated by commas:"
            " 'subnet-a;subnet-b' is not one",
        ),
        (
            "HETEROPLANE_EC2_SECURITY_GROUP_IDS",
            "sg-1 sg-2",
            "ec2.security_group_ids: must be AWS ids (subnet-0abc, sg-0abc) separated by"
            " commas: 'sg-1 sg-2' is not one",
        ),
        (
            "HETEROPLANE_EC2_SUBNET_IDS",
            '["subnet-a",',
            "ec2.subnet_ids: must be ids separated by commas, or a JSON list",
        ),
    ],
)
def test_bad_flat_ec2_environment(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, message: str
) -> None:
    for name, good in FLAT_EC2.items():
        monkeypatch.setenv(name, good)
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError) as caught:
        load_settings()
    assert str(caught.value).startswith(message)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        (
            "HETEROPLANE_EC2__SUBNET_IDS",
            "subnet-a,subnet-b",
            'ec2.subnet_ids: must be JSON in this nested form (["subnet-a","subnet-b"]), or'
            " use HETEROPLANE_EC2_SUBNET_IDS=subnet-a,subnet-b, got 'subnet-a,subnet-b'"
            " (HETEROPLANE_EC2__SUBNET_IDS)",
        ),
        (
            "HETEROPLANE_EC2__LAUNCH_TEMPLATES",
            "g4dn.xlarge=lt-0123",
            "ec2.launch_templates: must be JSON in this nested form"
            ' ({"g4dn.xlarge":"lt-0123"}), or use'
            " HETEROPLANE_EC2_LAUNCH_TEMPLATES=g4dn.xlarge=lt-0123, got 'g4dn.xlarge=lt-0123'"
            " (HETEROPLANE_EC2__LAUNCH_TEMPLATES)",
        ),
    ],
)
def test_a_nested_list_that_is_not_json_is_one_line(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, message: str
) -> None:
    """The nested form of a list or a mapping is JSON: its flat form there was pydantic-settings'
    own error, a traceback out of every command that reads the settings."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError) as caught:
        load_settings()
    assert str(caught.value) == message


def test_bad_flat_value_names_the_flat_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, good in FLAT_EC2.items():
        monkeypatch.setenv(name, good)
    monkeypatch.setenv("HETEROPLANE_EC2_MAX_ATTEMPTS", "0")
    with pytest.raises(SettingsError, match=r"\(HETEROPLANE_EC2_MAX_ATTEMPTS\)"):
        load_settings()


def test_a_base_url_loses_its_trailing_slash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETEROPLANE_SERVING_URL", "http://127.0.0.1:8000/")
    assert load_settings().serving_url == "http://127.0.0.1:8000"
