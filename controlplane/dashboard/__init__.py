"""The ops dashboard at ``/dashboard``: a page that signs in with an API token (viewer scope;
the browser keeps only a server-side session's id in an HttpOnly cookie) and polls one JSON
snapshot every 2 s to draw the fleet, cost, load, latency, cascade, decision and plan panels
(docs/dashboard.md).

Layout: ``session`` (the sign-in cookie and its settings), ``routes`` (the page, sign-in, the
data route and the assets, mounted on the API by
:func:`install_dashboard`), ``snapshot`` (the panels' data from the store), ``ranking`` (the
Kairos bound ranking behind the applied plan), ``static/`` (plain HTML, CSS and JavaScript: the
charts are hand-drawn SVG, no library and no build step).
"""

from __future__ import annotations

from controlplane.dashboard.routes import COOKIE_NAME, install_dashboard
from controlplane.dashboard.session import SessionSettings

__all__ = ["COOKIE_NAME", "SessionSettings", "install_dashboard"]
