"""The user data of EC2 workers that serve models a user brings (``provisioners.ec2``,
:func:`~provisioners.ec2.worker_user_data`): terraform's worker template with ``--artifact`` for
each model on its ``ExecStart`` line, which the worker agent parses back to the same references;
everything else in the template untouched; quoting that survives systemd; EC2's 16 KB refused
with one line. The launch itself, against moto: tests/integration/test_ec2_artifacts.py."""

from __future__ import annotations

import dataclasses
import shlex

import pytest

from provisioners.artifacts import ArtifactRef
from provisioners.ec2 import USER_DATA_MAX_BYTES, WORKER_COMMAND, worker_user_data
from provisioners.errors import InvalidConfigurationError
from tests.worker_template import WORKER_VARIABLES, render_worker_template

SHA = "ab" * 32
WORKER_ID = "i-0123456789abcdef0"


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


def test_the_template_starts_the_agent_the_provisioner_looks_for() -> None:
    # The fixed parts the provisioner relies on are terraform's (one place: the template).
    line = exec_start(render_worker_template("g4dn.xlarge"))
    assert WORKER_COMMAND in line
    port = WORKER_VARIABLES["worker_port"]
    assert f"python {WORKER_COMMAND} --host 0.0.0.0 --port {port} " in line
    assert "--artifact" not in line and "--models" not in line


def test_artifacts_go_on_the_agents_command_line_and_nowhere_else() -> None:
    from provisioners.worker.agent import parse_args

    template = render_worker_template("g4dn.xlarge")
    refs = [ref("wine"), ref("wine-big", version=3)]
    script = worker_user_data(template, refs)

    before, after = template.splitlines(), script.splitlines()
    assert len(before) == len(after)
    changed = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b]
    assert [before[i] for i in changed] == [exec_start(template)]
    assert script.endswith("\n") == template.endswith("\n")

    argv = systemd_argv(exec_start(script))
    assert argv[1:3] == ["-m", "provisioners.worker"]
    config = parse_args(argv[3:])
    assert config.artifacts == tuple(refs)
    assert (config.host, config.port, config.instance_type) == ("0.0.0.0", 8080, "g4dn.xlarge")
    assert f"--artifact {refs[0].to_arg()}" in script


def test_a_torchscript_modules_inputs_survive_systemd() -> None:
    from provisioners.artifacts import TensorSpec
    from provisioners.worker.agent import parse_args

    odd = dataclasses.replace(
        ref("plain"), format="torchscript", inputs=(TensorSpec("x's %", "FP32", (-1, 4)),)
    )
    line = exec_start(worker_user_data(render_worker_template("t3.large"), [odd]))
    config = parse_args(systemd_argv(line)[3:])
    assert config.artifacts == (odd,)


def test_a_uri_that_needs_quoting_survives_systemd() -> None:
    odd = ref(uri=f"s3://bucket/my models/100%/$HOME's/{SHA}.onnx")
    line = exec_start(worker_user_data(render_worker_template("t3.large"), [odd]))
    assert "100%%" in line and "$$HOME" in line
    assert systemd_argv(line)[-2:] == ["--artifact", odd.to_arg()]


@pytest.mark.parametrize("bad", ["\n", "\r", "\x00", "\\"])
def test_control_characters_and_backslashes_are_refused(bad: str) -> None:
    odd = ref(uri=f"s3://bucket/models/wine/1/{bad}{SHA}.onnx")
    with pytest.raises(InvalidConfigurationError) as caught:
        worker_user_data(render_worker_template("t3.large"), [odd])
    assert caught.value.field == "artifacts"
    assert "\n" not in str(caught.value)


def test_default_models_give_way_to_the_artifacts() -> None:
    line = "ExecStart=/venv/bin/python -m provisioners.worker --models tiny,small --port 8080"
    assert worker_user_data(line, [ref()]) == (
        f"ExecStart=/venv/bin/python -m provisioners.worker --port 8080 --artifact {ref().to_arg()}"
    )


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
