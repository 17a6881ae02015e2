"""The user data of EC2 workers that serve models a user brings (``provisioners.ec2``,
:func:`~provisioners.ec2.worker_user_data`): the provider's bootstrap, which writes the agent's
``--artifact`` options to the file the worker template's agent reads (``--artifacts-file``),
then terraform's worker template as it is; the bootstrap run for real by bash, the agent
parsing back the same references; values that need no quoting; EC2's 16 KB refused with one
line. The launch itself, against moto: tests/integration/test_ec2_artifacts.py."""

from __future__ import annotations

import dataclasses
import shlex
import subprocess
from pathlib import Path

import pytest

from provisioners.artifacts import ArtifactRef
from provisioners.ec2 import (
    ARTIFACTS_FILE,
    ARTIFACTS_OPTION,
    USER_DATA_MAX_BYTES,
    WORKER_COMMAND,
    worker_user_data,
)
from provisioners.errors import InvalidConfigurationError
from provisioners.worker.agent import DEFAULT_MODELS, AgentConfig, parse_args
from tests.worker_template import WORKER_VARIABLES, render_worker_template

SHA = "ab" * 32
WORKER_ID = "i-0123456789abcdef0"
ETC = ARTIFACTS_FILE.rsplit("/", 1)[0]


def ref(name: str = "wine", uri: str | None = None, version: int = 1) -> ArtifactRef:
    uri = uri or f"s3://heteroplane-models-0123/models/{name}/{version}/{SHA}.onnx"
    return ArtifactRef(name, name, version, "onnx", SHA, uri)


def exec_start(script: str) -> str:
    (line,) = [row for row in script.splitlines() if row.startswith("ExecStart=")]
    return line


def systemd_argv(line: str) -> list[str]:
    """The command systemd runs for an ``ExecStart=`` line of ours: its variables set
    (``$${X}`` in the template is ``${X}`` here), ``%%`` and ``$$`` undone, split with the
    shell's quotes (what systemd's splitting does for the quotes we write)."""
    text = line.removeprefix("ExecStart=").replace("${HETEROPLANE_WORKER_ID}", WORKER_ID)
    return shlex.split(text.replace("%%", "%").replace("$$", "$"))


def booted_agent(script: str, template: str, root: Path) -> AgentConfig:
    """What the worker's agent is configured with after ``script`` booted it: the provider's
    bootstrap (everything before the template) run by bash with ``/etc/heteroplane`` moved
    under ``root``, then the template's agent command line parsed with that file."""
    assert script.endswith(template)
    bootstrap = script[: len(script) - len(template)]
    etc = root / "etc"
    subprocess.run(["bash", "-c", bootstrap.replace(ETC, str(etc))], check=True)
    argv = systemd_argv(exec_start(template))
    assert argv[1:3] == ["-m", "provisioners.worker"]
    return parse_args([arg.replace(ETC, str(etc)) for arg in argv[3:]])


def test_the_template_starts_the_agent_the_provisioner_looks_for() -> None:
    # The fixed parts the provisioner relies on are terraform's (one place: the template).
    line = exec_start(render_worker_template("g4dn.xlarge"))
    assert WORKER_COMMAND in line
    port = WORKER_VARIABLES["worker_port"]
    assert f"python {WORKER_COMMAND} --host 0.0.0.0 --port {port} " in line
    assert "--artifact " not in line and "--models" not in line
    assert ARTIFACTS_OPTION in line


def test_artifacts_reach_the_agent_and_the_template_runs_as_it_is(tmp_path: Path) -> None:
    template = render_worker_template("g4dn.xlarge")
    refs = [ref("wine"), ref("wine-big", version=3)]
    script = worker_user_data(template, refs)

    # The template's script follows the bootstrap unchanged (nothing of it is rewritten).
    assert script.endswith(template) and len(script) > len(template)
    config = booted_agent(script, template, tmp_path)
    assert config.artifacts == tuple(refs)
    assert config.models == ("wine", "wine-big")  # no family model beside them
    assert (config.host, config.port, config.instance_type) == ("0.0.0.0", 8080, "g4dn.xlarge")
    assert f"--artifact {refs[0].to_arg()}" in script
    assert (tmp_path / "etc" / "artifacts").read_text().splitlines() == [
        f"--artifact {r.to_arg()}" for r in refs
    ]


def test_without_the_file_the_agent_serves_the_family() -> None:
    line = exec_start(render_worker_template("g4dn.xlarge"))
    config = parse_args(systemd_argv(line)[3:])  # /etc/heteroplane/artifacts is not here
    assert config.artifacts == ()
    assert config.models == DEFAULT_MODELS


def test_a_torchscript_modules_inputs_reach_the_agent(tmp_path: Path) -> None:
    from provisioners.artifacts import TensorSpec

    odd = dataclasses.replace(
        ref("plain"), format="torchscript", inputs=(TensorSpec("x's %", "FP32", (-1, 4)),)
    )
    template = render_worker_template("t3.large")
    config = booted_agent(worker_user_data(template, [odd]), template, tmp_path)
    assert config.artifacts == (odd,)


def test_a_uri_shells_and_systemd_would_quote_reaches_the_agent(tmp_path: Path) -> None:
    odd = ref(uri=f"s3://bucket/my models/100%/$HOME's/{SHA}.onnx")
    template = render_worker_template("t3.large")
    config = booted_agent(worker_user_data(template, [odd]), template, tmp_path)
    assert config.artifacts == (odd,)


@pytest.mark.parametrize("bad", ["\n", "\r", "\x00", "\\"])
def test_control_characters_and_backslashes_are_refused(bad: str) -> None:
    odd = ref(uri=f"s3://bucket/models/wine/1/{bad}{SHA}.onnx")
    with pytest.raises(InvalidConfigurationError) as caught:
        worker_user_data(render_worker_template("t3.large"), [odd])
    assert caught.value.field == "artifacts"
    assert "\n" not in str(caught.value)


TWO_AGENTS = "ExecStart=/a -m provisioners.worker\nExecStart=/b -m provisioners.worker\n"


@pytest.mark.parametrize("script", ["#!/bin/bash\necho no agent here\n", TWO_AGENTS])
def test_user_data_without_one_agent_line_is_refused(script: str) -> None:
    with pytest.raises(InvalidConfigurationError) as caught:
        worker_user_data(script, [ref()], source="launch template lt-1")
    assert caught.value.field == "launch_templates"
    assert "launch template lt-1" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_user_data_over_16_kb_is_refused_with_one_line() -> None:
    template = render_worker_template("t3.large")
    long_uri = "s3://heteroplane-models-0123/models/" + "x" * 900 + f"/{SHA}.onnx"
    refs = [ref(f"m{i}", uri=long_uri) for i in range(20)]
    with pytest.raises(InvalidConfigurationError) as caught:
        worker_user_data(template, refs)
    message = str(caught.value)
    assert caught.value.field == "artifacts"
    assert "\n" not in message
    assert str(USER_DATA_MAX_BYTES) in message and "16 KB" in message
    # Right at the limit is still fine: the limit is EC2's, on the bytes before base64.
    fits = [ref(f"m{i}", uri=long_uri) for i in range(8)]
    assert len(worker_user_data(template, fits).encode()) <= USER_DATA_MAX_BYTES


def test_a_malformed_artifacts_file_is_a_one_line_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "artifacts"
    path.write_text(f"--artifact {ref().to_arg()}\n--models tiny\n")
    with pytest.raises(SystemExit) as exited:
        parse_args(["--instance-type", "t3.large", "--artifacts-file", str(path)])
    assert exited.value.code == 2
    (message,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert f"--artifacts-file {path}, line 2" in message
