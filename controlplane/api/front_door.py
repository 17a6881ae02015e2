"""The front door: inference queries refused as the HTTP protocol reads their head.

The HTTP protocol (:class:`controlplane.service.protocol.HeadLimitedHttpToolsProtocol`) asks
:meth:`FrontDoor.refuse` for each plain inference request (``POST /v1/apps/{app}/infer``,
``POST /v2/models/{app}/infer``) once its head is read; True, and the protocol answers the 429
itself, with no request cycle, task or app. The throttle decides
(:class:`controlplane.serving.throttle.FrontThrottle`, which says why and how much); the
serving loop records the refusal as admission records its own (an arrival and a refused query:
:meth:`controlplane.serving.loop.ServingLoop.refused_at_front`), and the request counter
counts the 429 under the app, as ``/metrics`` counts every answer. The inference fast path
tells the throttle admission's verdict on every query the front let through
(:meth:`FrontDoor.answered`).

Nothing here looks at the token: past saturation an app's queries are refused before their
token is checked, as a load balancer's overload answer would be. The answer says only that
the app is overloaded; the app's name is the request's own.
"""

from __future__ import annotations

from controlplane.api.counters import RequestCounter
from controlplane.serving.loop import ServingLoop
from controlplane.serving.throttle import FrontThrottle

__all__ = ["RETRY_AFTER_S", "FrontDoor", "front_message"]

# The Retry-After of a refusal at the front, s (admission's own says when its backlog drains;
# the front's share follows the overload within about a second).
RETRY_AFTER_S = 1


def front_message(app: str) -> str:
    """The refusal's message."""
    return (
        f"app {app!r} is overloaded: the query was refused on arrival, as admission control"
        f" refuses queries its queues cannot serve within the SLO; retry after {RETRY_AFTER_S} s"
    )


class FrontDoor:
    """The throttle, the serving loop and the request counter, as the protocol needs them."""

    def __init__(
        self,
        throttle: FrontThrottle,
        serving: ServingLoop,
        counter: RequestCounter,
    ) -> None:
        self.throttle = throttle
        self.serving = serving
        self.counter = counter

    def refuse(self, app: str) -> bool:
        """Whether the query of ``app`` whose head was just read is refused at the front (then
        recorded and counted here; the caller answers the 429)."""
        if not self.throttle.refuse(app):
            return False
        if not self.serving.refused_at_front(app):
            return False
        self.counter.add(app, 429)
        return True

    def answered(self, app: str, status: int) -> None:
        """The fast path's answer ``status`` to a query of ``app`` the front let through."""
        self.throttle.answered(app, status != 429)
