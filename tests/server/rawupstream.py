"""A raw asyncio HTTP/1.1 upstream on loopback that misbehaves on purpose, for the wire tests.

Each request it reads (head up to the blank line, then ``Content-Length`` bytes) is answered by a
script: a sequence of steps run in order on that connection, each ``bytes`` (written and drained),
a ``float`` (seconds to sleep) or ``CLOSE`` (close the connection). Whatever the script does, the
server then goes on reading the next request on the same connection (until it is closed). It never
closes an idle connection itself; ``ended`` holds the numbers of the connections the client closed
between requests.
With ``tls`` (a server context) it speaks HTTPS.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvroute.server.cluster import free_port

__all__ = ["CLOSE", "RawRequest", "RawUpstream", "Step", "ok"]

CLOSE = object()
"""A script step: close the connection."""

Step = bytes | float | object


@dataclass(frozen=True)
class RawRequest:
    """One request as the upstream read it: ``conn`` numbers the connections (from 0), ``index``
    the requests on that connection (from 0); ``headers`` as (name, value) in wire order."""

    conn: int
    index: int
    head: bytes
    body: bytes
    headers: tuple[tuple[str, str], ...] = field(default=())

    def values(self, name: str) -> list[str]:
        """Every value of header ``name`` (case-insensitive), in wire order."""
        low = name.lower()
        return [v for k, v in self.headers if k.lower() == low]


def ok(body: bytes, ctype: str = "application/json") -> bytes:
    """A well-formed 200 with a ``Content-Length`` body."""
    return b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s" % (
        ctype.encode(),
        len(body),
        body,
    )


class RawUpstream:
    """The server: ``script(request)`` gives the steps answering ``request``."""

    def __init__(
        self, script: Callable[[RawRequest], Sequence[Step]], tls: ssl.SSLContext | None = None
    ) -> None:
        self.script = script
        self.tls = tls
        self.requests: list[RawRequest] = []
        self.url = ""
        self._server: asyncio.Server | None = None
        self._conns = 0
        self.ended: set[int] = set()  # connections the client closed between requests (EOF at a head)
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> RawUpstream:
        port = free_port()
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", port, ssl=self.tls)
        self.url = f"{'https' if self.tls else 'http'}://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for w in self._writers:
            w.close()
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(BaseException):
                await t

    @property
    def connections(self) -> int:
        return self._conns

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.append(writer)
        conn = self._conns
        self._conns += 1
        try:
            for index in range(1 << 30):
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError as exc:
                    if not exc.partial:
                        self.ended.add(conn)
                    return
                except ConnectionError:
                    return
                lines = head.decode("latin-1").split("\r\n")[1:-2]
                headers = tuple((k.strip(), v.strip()) for k, _, v in (ln.partition(":") for ln in lines))
                length = sum(int(v) for k, v in headers if k.lower() == "content-length")
                body = await reader.readexactly(length) if length else b""
                req = RawRequest(conn, index, head, body, headers)
                self.requests.append(req)
                for step in self.script(req):
                    if step is CLOSE:
                        writer.close()
                        return
                    if isinstance(step, float):
                        await asyncio.sleep(step)
                    else:
                        assert isinstance(step, bytes)
                        writer.write(step)
                        await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:  # the server is closing: end quietly
            pass
        finally:
            self._tasks.discard(task)
            writer.close()
