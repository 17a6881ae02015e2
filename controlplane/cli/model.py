"""The model registry's commands, against a running service (``/v1/models``, docs/models.md):

- ``heteroplane model push NAME FILE [--format onnx|torchscript] [--inputs SPEC]``: upload the
  file (streamed) as the next version of ``NAME``; the service inspects it and answers the
  version document (``unchanged``, not ``pushed``, when the newest version is that file);
- ``heteroplane model list``: every version of every model;
- ``heteroplane model show NAME[@VERSION]``: a model's versions, or one version.

Each prints a summary or a table, or with ``--json`` the server's JSON as one object. A missing
file, a name that is not a DNS label and every error answer of the API are one line and exit
status 2. Like :mod:`controlplane.cli.operate`, nothing here imports more than httpx.
"""

from __future__ import annotations

import argparse
import re
import urllib.parse
from pathlib import Path
from typing import Any

from controlplane.cli.client import client_from, table
from controlplane.cli.output import UsageError, emit
from controlplane.cli.parsers import MODEL_NAME_PATTERN

__all__ = ["model_list", "model_push", "model_show"]

_NAME = re.compile(MODEL_NAME_PATTERN)
_REFERENCE = re.compile(r"^(?P<name>[^@]+)(@(?P<version>[0-9]+))?$")


def _check_name(name: str) -> str:
    if not _NAME.match(name):
        raise UsageError(
            f"model name {name!r} is not a DNS label: 1 to 63 lower-case letters, digits and"
            " '-', starting and ending with a letter or digit"
        )
    return name


def _model_path(name: str, *parts: str) -> str:
    return "/".join([f"/v1/models/{urllib.parse.quote(name, safe='')}", *parts])


def _tensors(tensors: list[dict[str, Any]]) -> str:
    return ", ".join(
        f"{t['name']} {t['datatype']}[{','.join(str(d) for d in t['shape'])}]" for t in tensors
    )


def _version_line(version: dict[str, Any]) -> str:
    return (
        f"{version['name']}@{version['version']}: {version['format']},"
        f" {version['size_bytes']:,} bytes, sha256 {version['sha256'][:12]}...;"
        f" inputs {_tensors(version['inputs'])}; outputs {_tensors(version['outputs'])}"
    )


def _version_details(version: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"{version['name']}@{version['version']}",
            f"  format:     {version['format']}",
            f"  size:       {version['size_bytes']:,} bytes",
            f"  sha256:     {version['sha256']}",
            f"  inputs:     {_tensors(version['inputs'])}",
            f"  outputs:    {_tensors(version['outputs'])}",
            f"  uri:        {version['uri']}",
            f"  created at: {version['created_at']}",
        ]
    )


def _rows(versions: list[dict[str, Any]]) -> list[list[Any]]:
    return [
        [
            v["name"],
            v["version"],
            v["format"],
            v["size_bytes"],
            _tensors(v["inputs"]),
            _tensors(v["outputs"]),
            v["sha256"][:12],
            v["created_at"],
        ]
        for v in versions
    ]


_HEADERS = ["MODEL", "VERSION", "FORMAT", "SIZE_BYTES", "INPUTS", "OUTPUTS", "SHA256", "CREATED"]


def model_push(args: argparse.Namespace) -> int:
    name = _check_name(args.name)
    path = Path(args.file)
    if not path.is_file():
        raise UsageError(f"no model file at {path}")
    query = {"format": args.format, "inputs": args.inputs}
    with client_from(args) as client, path.open("rb") as content:
        version = client.upload(_model_path(name), content, **query)
    # An answer without "created" (a service from before it) made a version.
    if version.get("created", True):
        return emit(args.json, version, lambda: f"pushed {_version_line(version)}")
    return emit(
        args.json,
        version,
        lambda: f"unchanged {_version_line(version)} (its newest version holds this file already)",
    )


def model_list(args: argparse.Namespace) -> int:
    with client_from(args) as client:
        answer = client.get("/v1/models")
    versions = answer["models"]
    return emit(
        args.json,
        answer,
        lambda: table(_HEADERS, _rows(versions)) if versions else "no models",
    )


def model_show(args: argparse.Namespace) -> int:
    found = _REFERENCE.fullmatch(args.reference)
    if found is None:
        raise UsageError(f"model reference {args.reference!r}: expected NAME or NAME@VERSION")
    name = _check_name(found["name"])
    with client_from(args) as client:
        if found["version"] is not None:
            version = client.get(_model_path(name, "versions", str(int(found["version"]))))
            return emit(args.json, version, lambda: _version_details(version))
        model = client.get(_model_path(name))
    versions = model["versions"]
    return emit(
        args.json,
        model,
        lambda: "\n\n".join(
            [table(_HEADERS, _rows(versions)), "newest: " + _version_details(versions[-1])]
        ),
    )
