"""The API against its own OpenAPI document: a bounded schemathesis run over every operation of
``/openapi.json``, in process (ASGI), on a real SQLite database migrated through the real
migrations, with an admin token and an app and a plan in the store (so that ``{app}`` and
``{plan_id}`` can name real objects too).

schemathesis' engine runs its example, coverage and fuzzing phases (the ones ``schemathesis
run`` runs; the stateful phase is off: it follows links the document does not declare), positive
and negative data, derandomized and bounded (:data:`MAX_EXAMPLES` per operation), so that a CI run
is reproducible and takes seconds. Every answer must be:

- no server error: no 5xx at all, except a 5xx the operation documents with its own error code
  (``POST /v1/apps/{app}/infer`` answers 503 ``serving_unavailable`` here: this service runs no
  serving loop), never 500 ``internal``;
- a status, a content type, headers and a body the document declares for the operation;
- for a request the schema allows, not a 4xx other than the ones that depend on state (401, 403,
  404, 409) or on what a JSON Schema cannot say (:data:`BEYOND_THE_SCHEMA`: a spec's files and
  catalog names, a body that contradicts the path, fields that exclude each other);
- for a request the schema forbids, a 4xx; for a method a path does not serve, 405 with an
  ``Allow`` header naming every method it does; without a token, 401.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import ServerError
from schemathesis.engine import Status, events, from_schema
from schemathesis.openapi.checks import RejectedPositiveData
from schemathesis.specs.openapi.checks import positive_data_acceptance

from controlplane.clock import FakeClock
from controlplane.db.store import Store
from controlplane.service.app import create_app
from controlplane.settings import Settings
from tests.component.test_api import spec, write_profiles

# Per operation and phase: 25 finds every problem the 57,932-case exploratory run of issue 21
# found, in about 15 s on two cores. HETEROPLANE_FUZZ_EXAMPLES and HETEROPLANE_FUZZ_SEED dig
# further locally.
MAX_EXAMPLES = int(os.environ.get("HETEROPLANE_FUZZ_EXAMPLES", "25"))
SEED = int(os.environ.get("HETEROPLANE_FUZZ_SEED", "21"))

# Rejections of schema-valid requests that the schema cannot express, by operation: (status,
# error code, field or None for any field). Each says which rule of the API it is.
BEYOND_THE_SCHEMA: dict[str, set[tuple[int, str, str | None]]] = {
    # A spec names profile, catalog and validation files and catalog instance types: whether
    # they exist is the data directory's business, not the document's.
    "POST /v1/apps": {(422, "invalid_spec", None)},
    "PUT /v1/apps/{app}": {
        (422, "invalid_spec", None),
        # The body's name must be the path's.
        (422, "invalid_request", "name"),
    },
    # ?drain=true&force=true: the two exclude each other (a JSON Schema of parameters cannot say).
    "DELETE /v1/apps/{app}": {(422, "invalid_request", "drain")},
    # Whether a rate can be planned depends on the app's profiles and SLO (and a batch size on
    # its profiles); a trace's bound on rate_qps x duration_s spans two fields.
    "POST /v1/apps/{app}/plans": {
        (422, "unplannable", None),
        (422, "invalid_request", "trace"),
    },
    # Whether bytes are a servable model only loading them can tell (the registry's inspector).
    "POST /v1/models/{name}": {(422, "invalid_model", None)},
    # One sample id per input (two arrays of one length); requirements no variant meets.
    "POST /v1/apps/{app}/infer": {
        (422, "invalid_request", "sample_ids"),
        (422, "requirements_unmet", "requirements"),
    },
}


def _error(content: bytes) -> tuple[str, str | None] | None:
    """The error body's code and field, or None when the body is not the API's error body."""
    try:
        body = json.loads(content)
        return str(body["error"]["code"]), body["error"]["field"]
    except (ValueError, KeyError, TypeError):
        return None


@schemathesis.check
def no_undocumented_server_error(
    ctx: schemathesis.CheckContext, response: schemathesis.Response, case: schemathesis.Case[Any]
) -> bool | None:
    """``not_a_server_error``, except a 5xx the operation documents, with an error code of its
    own (never ``internal``, the answer to a bug)."""
    try:
        return not_a_server_error(ctx, response, case)
    except ServerError:
        error = _error(response.content)
        documented = case.operation.responses.status_codes
        if str(response.status_code) in documented and error is not None and error[0] != "internal":
            return None
        raise


@schemathesis.check
def schema_valid_request_accepted(
    ctx: schemathesis.CheckContext, response: schemathesis.Response, case: schemathesis.Case[Any]
) -> bool | None:
    """``positive_data_acceptance``, except the rejections in :data:`BEYOND_THE_SCHEMA`."""
    try:
        return positive_data_acceptance(ctx, response, case)
    except RejectedPositiveData:
        error = _error(response.content)
        if error is not None:
            code, field = error
            for status, allowed_code, allowed_field in BEYOND_THE_SCHEMA.get(
                case.operation.label, set()
            ):
                if (response.status_code, code) == (status, allowed_code) and (
                    allowed_field is None or field == allowed_field
                ):
                    return None
        raise


CHECKS = (
    "no_undocumented_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
    "schema_valid_request_accepted",
    "negative_data_rejection",
    "missing_required_header",
    "unsupported_method",
    "allow_header_conformance",
    "ignored_auth",
)


@dataclass
class Target:
    app: FastAPI
    token: str


@pytest.fixture
def target(tmp_path: Path) -> Iterator[Target]:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    write_profiles(data_dir)
    settings = Settings(data_dir=data_dir, provisioner="fake")
    clock = FakeClock()
    store = Store.from_url(settings.database_url, clock, upgrade=True)
    token = store.create_token("admin", name="fuzz")
    app = create_app(settings, store, clock)
    headers = {"Authorization": f"Bearer {token}"}
    with TestClient(app) as client:
        assert client.post("/v1/apps", json=spec(), headers=headers).status_code == 201
        plan = client.post("/v1/apps/toy/plans", json={"rate_qps": 50.0}, headers=headers)
        assert plan.status_code == 201, plan.text
        yield Target(app, token)
    store.close()


def fuzz(target: Target) -> tuple[int, int, list[str]]:
    """Run schemathesis over every operation: the operations, the requests and the failures."""
    config = schemathesis.Config.from_dict(
        {
            "seed": SEED,
            "headers": {"Authorization": f"Bearer {target.token}"},
            "generation": {"max-examples": MAX_EXAMPLES, "deterministic": True},
            "phases": {"stateful": {"enabled": False}},
            "checks": {"enabled": False, **{name: {"enabled": True} for name in CHECKS}},
        }
    )
    schema = schemathesis.openapi.from_asgi("/openapi.json", target.app, config=config)
    operations = sum(1 for _ in schema.get_all_operations())
    statuses, failures = run_schema(schema)
    return operations, len(statuses), failures


def run_schema(schema: Any) -> tuple[list[int], list[str]]:
    """Run schemathesis' engine over ``schema``: the status of every answer, and every failed
    check (with the request that failed it and the start of the answer)."""
    statuses: list[int] = []
    failures: list[str] = []
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            recorder = event.recorder
            statuses += [
                i.response.status_code
                for i in recorder.interactions.values()
                if i.response is not None
            ]
            for case_id, checks in recorder.checks.items():
                for check in checks:
                    if check.status != Status.FAILURE or check.failure_info is None:
                        continue
                    interaction = recorder.interactions.get(case_id)
                    answer = interaction.response if interaction is not None else None
                    body = answer.content[:300].decode(errors="replace") if answer else ""
                    failures.append(
                        f"{event.label}: {check.name}: {check.failure_info.failure.title}\n"
                        f"  {check.failure_info.code_sample}\n  -> {body}"
                    )
        elif isinstance(event, events.NonFatalError | events.FatalError):
            failures.append(f"schemathesis error: {event}")
    return statuses, failures


def test_every_operation_answers_as_its_schema_says(target: Target) -> None:
    operations, requests, failures = fuzz(target)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(sorted(set(failures)))
    # Every operation was tried, many times each (a broken schema or token would not be).
    assert operations >= 20 and requests >= 20 * operations, (operations, requests)
