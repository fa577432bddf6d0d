"""Admin routes and logs against hostile clients, over real sockets to a real ``kvroute up`` (one
emulated engine): a header that is not UTF-8 is a JSON 401, never a 500; no log line can be forged
through a path or a header; no credential is written to the log, the admin token included."""

from __future__ import annotations

import json
import signal
import socket
from collections.abc import Iterator

import pytest

from .upproc import Up, start_up

TOKEN = "adm1n-t0ken-do-not-log"


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    tmp = tmp_path_factory.mktemp("up")
    u = start_up(tmp, "--instances", "1", env={"KVROUTE_ADMIN_TOKEN": TOKEN})
    try:
        yield u
    finally:
        u.kill_all()


def exchange(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """One request written as ``raw`` bytes (it must ask ``Connection: close``): status, headers, body."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(raw)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, body


def request(method: str, target: bytes, auth: bytes | None, extra: bytes = b"") -> bytes:
    raw = method.encode() + b" " + target + b" HTTP/1.1\r\nHost: router\r\n"
    if auth is not None:
        raw += b"Authorization: " + auth + b"\r\n"
    return raw + extra + b"Content-Length: 0\r\nConnection: close\r\n\r\n"


BAD_AUTH = (b"Bearer \xff\xfe", b"Bearer " + TOKEN.encode() + b"\xff", b"\x80\x81", b"Bearer \xc3\x28")
ROUTES = (
    ("GET", b"/admin/backends"),
    ("POST", b"/admin/backends"),
    ("GET", b"/admin/backends/abc"),
    ("DELETE", b"/admin/backends/x%0aFORGED:%20backend%20deleted"),
    ("POST", b"/admin/backends/abc/drain"),
    ("GET", b"/debug/decisions"),
    ("GET", b"/debug/state"),
    ("GET", b"/debug/dashboard"),
)


def test_non_utf8_authorization_is_a_json_401(up: Up) -> None:
    for auth in BAD_AUTH:
        for method, target in ROUTES:
            status, headers, body = exchange(up.port, request(method, target, auth))
            assert status == 401, (method, target, auth, body)
            assert headers["content-type"].startswith("application/json")
            assert headers["www-authenticate"] == "Bearer"
            assert json.loads(body)["error"]["code"] == 401
    # the right token still opens them
    status, _, body = exchange(up.port, request("GET", b"/admin/backends", b"Bearer " + TOKEN.encode()))
    assert status == 200 and len(json.loads(body)["data"]) == 1


def test_log_lines_cannot_be_forged_and_hold_no_credential(up: Up) -> None:
    for auth in BAD_AUTH:
        exchange(up.port, request("DELETE", b"/admin/backends/x%0aFORGED: deleted%1b[2J", auth))
    # parser errors quote the offending header line, control bytes and credentials included
    bad_lines = (
        b"Authorization: Bearer sk-client-key\x01tail\r\n",
        b"Authorization : Bearer sk-client-key\r\n",
        b"Proxy-Authorization: Basic sk-client-key\x7f\r\n",
        b"X-Note: FORGED\x1b[31m\x00\r\n",
    )
    for extra in bad_lines:
        status, _, body = exchange(up.port, request("GET", b"/v1/models", None, extra))
        assert status == 400, body
        assert b"sk-client-key" not in body
    exchange(up.port, request("GET", b"/nope%0aFORGED%0d%1b[31m", b"Bearer " + TOKEN.encode()))
    up.proc.send_signal(signal.SIGINT)
    up.proc.wait(60)
    log = up.log()
    text = log.decode("utf-8")  # every byte written is UTF-8 (undecodable input escaped)
    lines = text.splitlines()
    assert not [ln for ln in lines if ln.startswith("FORGED")], text
    assert all(ln.isprintable() for ln in lines), text
    assert "Traceback" not in text and "internal error" not in text, text
    assert TOKEN not in text and "sk-client-key" not in text, text
    assert "bad HTTP request" in text  # the parser errors were logged, escaped and redacted
    assert "<admin token>" in text and "#token=" not in text
