"""The optional extras (pyproject.toml): boto3 (``aws``), psycopg (``postgres``) and matplotlib
(``bench``) are not needed by the README's main command (``make demo``: SQLite, the local
provisioner), and selecting what needs one without it installed is a one-line error naming the
extra. "Not installed" is simulated by a ``None`` in ``sys.modules`` (Python's own way to make an
import fail)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from controlplane.errors import DatabaseError, SettingsError
from controlplane.provisioning import build_provisioner
from controlplane.settings import Ec2Settings, Settings

EC2 = Ec2Settings(
    region="us-east-1", subnet_ids=["subnet-a"], security_group_ids=["sg-1"], ami_id="ami-1"
)


def test_ec2_without_boto3_is_a_one_line_settings_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "provisioners.ec2", raising=False)
    monkeypatch.setitem(sys.modules, "boto3", None)
    with pytest.raises(SettingsError) as caught:
        build_provisioner(Settings(provisioner="ec2", ec2=EC2))
    message = str(caught.value)
    assert message.startswith("provisioner: ec2 needs boto3")
    assert "pip install 'heteroplane[aws]'" in message and "\n" not in message


@pytest.mark.parametrize(
    "url", ["postgresql://hp:secret@127.0.0.1:1/hp", "postgresql+psycopg://h/d"]
)
def test_postgresql_without_psycopg_is_a_one_line_database_error(
    monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    from controlplane.db.lease import AdvisoryLock
    from controlplane.db.session import make_engine

    for name in [n for n in sys.modules if n == "psycopg" or n.startswith("psycopg.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "psycopg", None)
    for make in (make_engine, AdvisoryLock):
        with pytest.raises(DatabaseError) as caught:
            make(url)
        message = str(caught.value)
        assert "psycopg is not installed" in message
        assert "pip install 'heteroplane[postgres]'" in message
        assert "secret" not in message and "\n" not in message


def test_the_demo_path_imports_none_of_the_extras(tmp_path: Path) -> None:
    """The service ``make demo`` runs (SQLite, the local provisioner, the registry, the API)
    builds and closes in a process where boto3, botocore, psycopg and matplotlib cannot be
    imported."""
    script = textwrap.dedent(
        f"""
        import sys
        for name in ("boto3", "botocore", "psycopg", "matplotlib"):
            sys.modules[name] = None
        from controlplane.service.build import build_service
        from controlplane.service.demo import DEMO_APP
        from controlplane.settings import Settings
        service = build_service(Settings(data_dir={str(tmp_path)!r}))
        service.close()
        print("built", service.provisioner.name, type(service.store).__name__)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["built", "local", "Store"]
