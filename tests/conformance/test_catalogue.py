"""The suite's own parts, without a front door: the invariant's checks, and the misbehaving
upstream's bytes read by a well-kept parser (h11) to show each fault is what it says."""

from __future__ import annotations

import h11
import orjson
import pytest

from kvroute.conformance.faults import CLOSE, FAULTS, Answer
from kvroute.conformance.ids import FOREIGN_ID, ids_in, new_id
from kvroute.conformance.invariant import Expect, check_forwarded, check_response, completion_ids
from kvroute.conformance.rawhttp import RawResponse

RID = "cf-0123456789ab"


def _ok(body: bytes, rid: str = RID) -> RawResponse:
    return RawResponse(200, (("content-type", "application/json"), ("x-request-id", rid)), body)


def test_a_good_answer_keeps_the_invariant() -> None:
    assert check_response(_ok(Answer(RID, False, False, "m").body()), Expect(RID)) == []
    stream = b"".join(Answer(RID, True, True, "m").events())
    assert check_response(_ok(stream), Expect(RID, chat=True)) == []


def test_another_responses_bytes_are_caught() -> None:
    a = Answer(RID, False, False, "m")
    found = check_response(_ok(a.body() + a.foreign()), Expect(RID))
    assert any(FOREIGN_ID in v for v in found)


def test_a_wrong_completion_id_is_caught() -> None:
    other = new_id()
    found = check_response(_ok(Answer(other, False, False, "m").body()), Expect(RID))
    assert any("completion id" in v for v in found)
    assert any("another response's id" in v for v in found)


def test_a_5xx_for_a_clients_fault_and_a_text_error_are_caught() -> None:
    resp = RawResponse(502, (("content-type", "text/plain"),), b"Bad Gateway")
    found = check_response(resp, Expect(RID, allowed=frozenset()))
    assert any("for a client's fault" in v for v in found)
    assert any("not an OpenAI-style JSON error" in v for v in found)
    ok = RawResponse(502, (("content-type", "application/json"),), b'{"error": {"message": "x"}}')
    assert check_response(ok, Expect(RID, allowed=frozenset({502}), client_fault=False)) == []


def test_no_answer_is_a_violation_unless_a_close_is_allowed() -> None:
    assert check_response(None, Expect(RID)) != []
    assert check_response(None, Expect(RID, may_close=True)) == []


def test_an_unusable_client_id_is_replaced_by_the_echoed_one() -> None:
    made = "0f" * 16
    body = orjson.dumps({"id": "cmpl-" + made})
    assert check_response(_ok(body, made), Expect(None)) == []
    assert check_response(_ok(body, "cf-999999999999"), Expect(None)) != []


def test_completion_ids_of_json_and_sse() -> None:
    assert completion_ids(b'{"id": "cmpl-x"}') == ["cmpl-x"]
    assert completion_ids(b'data: {"id": "a"}\n\ndata: {"id": "b"}\n\ndata: [DONE]\n\n') == ["a", "b"]
    assert completion_ids(b"HTTP/1.1 200 OK") is None
    assert ids_in(b"x cf-0123456789ab y cf-0123456789ab") == {RID}


def test_forwarded_headers() -> None:
    good = [("Host", "h"), ("x-request-id", RID), ("Content-Type", "application/json")]
    assert check_forwarded(good) == []
    assert check_forwarded([*good, ("X-Request-Id", RID)]) == ["2 X-Request-Id headers reached the upstream"]
    assert check_forwarded([*good, ("TE", "trailers"), ("Expect", "100-continue")]) != []
    assert check_forwarded([*good, ("X-Secret", "1")], listed=("x-secret",)) != []


def _h11_read(fault: str, stream: bool) -> tuple[list[int], int, bytes]:
    """The interim statuses, final status and body a well-kept client reads from the fault's bytes."""
    answer = Answer(RID, stream, stream, "m")
    conn = h11.Connection(h11.CLIENT)
    conn.send(
        h11.Request(method="POST", target="/v1/completions", headers=[("Host", "x"), ("Content-Length", "0")])
    )
    conn.send(h11.EndOfMessage())
    for step in FAULTS[fault].plan(answer):
        if step is CLOSE:
            conn.receive_data(b"")
            break
        if isinstance(step, bytes):
            conn.receive_data(step)
    else:
        conn.receive_data(b"")  # the suite's reader reads on; here the plan's end is the end
    interim, status, body = [], 0, b""
    while True:
        ev = conn.next_event()
        if isinstance(ev, h11.InformationalResponse):
            interim.append(ev.status_code)
        elif isinstance(ev, h11.Response):
            status = ev.status_code
        elif isinstance(ev, h11.Data):
            body += ev.data
        elif (
            isinstance(ev, h11.EndOfMessage | h11.ConnectionClosed) or ev is h11.PAUSED or ev is h11.NEED_DATA
        ):
            return interim, status, body


# the faults whose first answer is the ordinary one (xchunked: h11 knows only chunked, so not here)
WELL_FORMED = sorted(n for n, f in FAULTS.items() if f.allowed == frozenset({200}) and n != "xchunked")


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("fault", WELL_FORMED)
def test_each_well_formed_fault_carries_the_ordinary_answer(fault: str, stream: bool) -> None:
    answer = Answer(RID, stream, stream, "m")
    interim, status, body = _h11_read(fault, stream)
    assert status == 200
    assert body == b"".join(answer.pieces())
    if fault.startswith("interim-"):
        assert interim and all(100 <= s < 200 for s in interim)


def test_the_interim_faults_send_what_they_say() -> None:
    assert _h11_read("interim-many", False)[0] == [100, 102, 103, 100]
    assert _h11_read("interim-103", True)[0] == [103]
