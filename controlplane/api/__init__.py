"""The control plane's REST API (FastAPI, under ``/v1``);
:func:`controlplane.service.app.create_app` builds the app around these routes.

Layout (FastAPI's full-stack template): ``routes/`` (one module per
resource), ``deps`` (the service's parts and bearer-token auth), ``schemas`` (request and
response bodies), ``errors`` (domain errors to HTTP, in one place), ``counters`` (answers by app and
status, for ``/metrics``). The routes are listed in docs/api.md.
"""
