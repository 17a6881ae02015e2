"""The control plane's REST API (FastAPI, under ``/v1``): :func:`create_app` builds it.

Layout (FastAPI's full-stack template): ``app`` (the factory), ``routes/`` (one module per
resource), ``deps`` (the service's parts and bearer-token auth), ``schemas`` (request and
response bodies), ``errors`` (domain errors to HTTP, in one place), ``resolver`` (app specs
against their data), ``counters`` (answers by app and status, for ``/metrics``). The routes are
listed in docs/api.md.
"""

from __future__ import annotations

from controlplane.api.app import create_app

__all__ = ["create_app"]
