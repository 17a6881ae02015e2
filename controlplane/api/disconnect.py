"""An inference request whose client has gone is cancelled, so that its query leaves the serving
loop's queue before it costs a worker call (docs/serving.md, "Overload").

Past saturation clients give up (their timeout) and close their connections, while the service
would go on queueing and serving their queries until its own give-up time: answered throughput
fell to a fraction of capacity, spent on answers nobody read, and the service took seconds to
become idle after the load stopped. :class:`CancelOnDisconnect` watches the connection of every
``POST`` to an inference route (``/v1/apps/{app}/infer``, ``/v2/models/{app}[/versions/{v}]/
infer``) once its body has arrived: when the server says the client disconnected
(``http.disconnect``) before the answer started, the request's handler is cancelled, which
cancels its query in the dispatcher (:meth:`~controlplane.serving.dispatcher.AppDispatcher.
_on_done` takes it out of its queue). Nothing is sent: nobody is there to read it.

The watch costs one task per inference request, waiting on the server's ``receive`` (which, after
the body, returns only when the client goes); a handler that itself reads ``receive`` after the
body gets the same message the watch got.
"""

from __future__ import annotations

import asyncio
import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["CancelOnDisconnect", "is_infer_path"]

_INFER_PATH = re.compile(r"^/(v1/apps/[^/]+|v2/models/[^/]+(/versions/[^/]+)?)/infer$")


def is_infer_path(path: str) -> bool:
    """Whether ``path`` is an inference route's.

    >>> is_infer_path("/v1/apps/demo/infer"), is_infer_path("/v2/models/m/versions/1/infer")
    (True, True)
    >>> is_infer_path("/v1/apps/demo"), is_infer_path("/v2/models/m/ready")
    (False, False)
    """
    return _INFER_PATH.match(path) is not None


class CancelOnDisconnect:
    """Cancel an inference request's handler when its client disconnects before the answer
    starts (see the module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not is_infer_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        handler = asyncio.current_task()
        assert handler is not None
        watch: asyncio.Task[Message] | None = None
        started = False
        gone = False

        async def watch_receive() -> Message:
            nonlocal gone
            message = await receive()
            if message["type"] == "http.disconnect" and not started:
                gone = True
                handler.cancel()
            return message

        async def receive_body() -> Message:
            nonlocal watch
            if watch is not None:  # the body is in: the next message is the watch's
                return await asyncio.shield(watch)
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                watch = asyncio.get_running_loop().create_task(watch_receive())
            return message

        async def send_answer(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive_body, send_answer)
        except asyncio.CancelledError:
            if not gone:
                raise
            handler.uncancel()  # ours: the client is gone, there is no one to answer
        finally:
            if watch is not None and not watch.done():
                watch.cancel()
