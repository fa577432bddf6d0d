"""A recording in-memory transport: every backend answers 200 with a small completion."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

COMPLETION = (
    b'{"id":"1","object":"text_completion","model":"m","choices":[{"index":0,"text":"x",'
    b'"finish_reason":"length"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}'
)


class OkResponse:
    status = 200
    content_type = "application/json"
    ended = True  # one chunk, the whole body

    async def read(self) -> bytes:
        return COMPLETION

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        yield COMPLETION

    def release(self) -> None:
        return None

    def abort(self) -> None:
        return None


class RecordingTransport:
    """Records ``(url, method, path, body)`` of every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str, bytes | None]] = []

    async def send(
        self,
        base_url: str,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> OkResponse:
        self.calls.append((base_url, method, path, body))
        return OkResponse()

    async def close(self) -> None:
        return None

    def posts(self) -> list[tuple[str, bytes | None]]:
        return [(u, b) for u, m, p, b in self.calls if m == "POST"]
