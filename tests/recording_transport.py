"""A socket's transport for driving uvicorn's protocol in process: enough of one for the
protocol to take requests, and it records each write (what one system call would send)."""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.server import ServerState

__all__ = ["RecordingTransport", "drive"]


class RecordingTransport(asyncio.Transport):
    """Records each write in ``writes``; ``closed`` once closed."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(
            name, default
        )

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def drive(config: Any, scenario: Any) -> None:
    """Run ``scenario(protocol, transport)`` on a new event loop against one connection of the
    HTTP protocol of the ``uvicorn.Config`` ``config``, on a :class:`RecordingTransport`."""

    async def main() -> None:
        config.load()
        protocol = config.http_protocol_class(
            config=config, server_state=ServerState(), app_state={}
        )
        transport = RecordingTransport()
        protocol.connection_made(transport)
        try:
            await scenario(protocol, transport)
        finally:
            protocol.connection_lost(None)
            await asyncio.sleep(0)

    asyncio.run(main())
