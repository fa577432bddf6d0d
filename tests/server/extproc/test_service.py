"""The picker's gRPC services driven directly, as a gateway would (a real gRPC client on loopback,
real ext_proc messages): what Envoy cannot be made to send here (a subset hint), the protocol's
answers in each mode, bodies over the limit, health, and a picker that is shutting down."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
import pytest

grpc = pytest.importorskip("grpc", reason="the gateway extra is not installed: pip install -e '.[gateway]'")
pytest.importorskip(
    "envoy.service.ext_proc.v3.external_processor_pb2", reason="the gateway extra is not installed"
)

from envoy.config.core.v3 import base_pb2  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc  # noqa: E402
from google.protobuf import struct_pb2  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from tests.server.extproc.harness import Gateway, eventually, leases_zero  # noqa: E402

from kvroute.server.config import BackendSpec, RouterConfig  # noqa: E402
from kvroute.server.extproc.messages import (  # noqa: E402
    BODY_PIECE,
    DESTINATION,
    LB_NAMESPACE,
    SUBSET,
    SUBSET_NAMESPACE,
)
from kvroute.server.extproc.server import EppServer  # noqa: E402
from kvroute.tokenizer import Tokenizer  # noqa: E402


def headers(path: str, method: str = "POST", end: bool = False, **more: str) -> pb.ProcessingRequest:
    pairs = {":method": method, ":path": path, ":authority": "gw", "content-type": "application/json", **more}
    hm = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    )
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hm, end_of_stream=end))


def body(data: bytes, end: bool = True, response: bool = False) -> pb.ProcessingRequest:
    b = pb.HttpBody(body=data, end_of_stream=end)
    return pb.ProcessingRequest(response_body=b) if response else pb.ProcessingRequest(request_body=b)


def with_subset(req: pb.ProcessingRequest, endpoints: list[str]) -> pb.ProcessingRequest:
    s = struct_pb2.Struct()
    s.update({SUBSET: endpoints})
    req.metadata_context.filter_metadata[SUBSET_NAMESPACE].CopyFrom(s)
    return req


def completion(prompt: str, **more: object) -> bytes:
    return orjson.dumps({"model": "emu", "prompt": prompt, "max_tokens": 2, **more})


async def exchange(port: int, msgs: list[pb.ProcessingRequest]) -> list[pb.ProcessingResponse]:
    """Send ``msgs`` on one ext_proc stream and collect the answers until the stream ends."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)

        async def gen() -> AsyncIterator[pb.ProcessingRequest]:
            for m in msgs:
                yield m

        return [r async for r in stub.Process(gen())]


def destination(r: pb.ProcessingResponse) -> tuple[str | None, str]:
    """(the destination header set, or None; the envoy.lb metadata's destination)."""
    mutation = r.request_headers.response.header_mutation
    header = next(
        (h.header.raw_value.decode() for h in mutation.set_headers if h.header.key == DESTINATION), None
    )
    meta = r.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION].string_value
    return header, meta


@pytest.fixture
async def picked(gateway: Gateway, tokenizer: Tokenizer) -> Gateway:
    for _ in range(2):
        await gateway.add_engine(tokenizer)
    await gateway.start_picker(tokenizer, max_body_bytes=200_000)
    return gateway


async def test_route_header_and_metadata_agree_and_body_comes_back(picked: Gateway) -> None:
    data = completion("x" * 150_000)  # more than two pieces
    out = await exchange(
        picked.grpc_port, [headers("/v1/completions"), body(data[:1000], end=False), body(data[1000:])]
    )
    header, meta = destination(out[0])
    assert header == meta and meta.split(",")[0] in picked.endpoints()
    assert len(meta.split(",")) == 2  # the fallback list: the other engine next
    pieces = [r.request_body.response.body_mutation.streamed_response for r in out[1:]]
    assert b"".join(p.body for p in pieces) == data
    assert [p.end_of_stream for p in pieces] == [False] * (len(pieces) - 1) + [True]
    assert all(len(p.body) <= BODY_PIECE for p in pieces) and len(pieces) == 3


async def test_a_client_destination_header_is_overwritten(picked: Gateway) -> None:
    forged = headers("/v1/completions", **{DESTINATION: "10.0.0.1:80"})
    out = await exchange(picked.grpc_port, [forged, body(completion("hello"))])
    header, meta = destination(out[0])
    assert header == meta and "10.0.0.1" not in header


async def test_metadata_only_removes_the_header(gateway: Gateway, tokenizer: Tokenizer) -> None:
    await gateway.add_engine(tokenizer)
    await gateway.start_picker(tokenizer, metadata_only=True)
    forged = headers("/v1/completions", **{DESTINATION: "10.0.0.1:80"})
    out = await exchange(gateway.grpc_port, [forged, body(completion("hello"))])
    header, meta = destination(out[0])
    assert header is None and meta == gateway.endpoints()[0]
    assert DESTINATION in out[0].request_headers.response.header_mutation.remove_headers


async def test_subset_hint_is_honoured(picked: Gateway) -> None:
    for target in picked.endpoints():
        for i in range(3):
            req = with_subset(headers("/v1/completions"), [target])
            out = await exchange(picked.grpc_port, [req, body(completion(f"prompt {i} " * 50))])
            assert destination(out[0]) == (target, target)
    req = with_subset(headers("/v1/completions"), ["10.9.9.9:1"])  # none of the pool
    out = await exchange(picked.grpc_port, [req, body(completion("hi"))])
    imm = out[0].immediate_response
    assert imm.status.code == 503 and b"no healthy backend" in imm.body
    assert leases_zero(picked.state)  # the streams ended with no response: nothing held


async def test_refusals_are_immediate_responses(picked: Gateway) -> None:
    port = picked.grpc_port
    out = await exchange(port, [headers("/v1/completions"), body(b"{", end=False), body(b"x" * 250_000)])
    imm = out[0].immediate_response
    assert imm.status.code == 413 and orjson.loads(imm.body)["error"]["code"] == 413
    out = await exchange(port, [headers("/v1/chat/completions"), body(b'{"model": "emu"}')])
    imm = out[0].immediate_response
    assert imm.status.code == 400 and orjson.loads(imm.body)["error"]["param"] == "messages"
    assert ("content-type", "application/json") in [
        (h.header.key, h.header.raw_value.decode()) for h in imm.headers.set_headers
    ]
    out = await exchange(port, [headers("/v1/completions", end=True)])
    assert out[0].immediate_response.status.code == 400
    assert picked.state.counters.rejected == 3


async def test_response_flow_settles_the_lease(picked: Gateway) -> None:
    """Envoy's side of a whole exchange, response included: the served endpoint, the first chunk
    (the lease's first token), the usage at the end (its cached tokens reach the record)."""
    port = picked.grpc_port
    state = picked.state
    usage = b'data: {"usage": {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}}}\n\n'
    served = picked.endpoints()[1]

    def resp_headers() -> pb.ProcessingRequest:
        hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")])
        r = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=hm))
        r.attributes["envoy.filters.http.ext_proc"].update({"upstream.address": served})
        return r

    q: asyncio.Queue[pb.ProcessingRequest | None] = asyncio.Queue()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)

        async def gen() -> AsyncIterator[pb.ProcessingRequest]:
            while (m := await q.get()) is not None:
                yield m

        call = stub.Process(gen())
        await q.put(with_subset(headers("/v1/completions"), [served]))
        await q.put(body(completion("count " * 40, stream=True)))
        first = await call.read()
        assert destination(first)[1] == served
        await call.read()  # the body handed back
        idx = picked.endpoints().index(served)
        assert state.backends[idx].waiting == 1
        await q.put(resp_headers())
        added = await call.read()
        keys = [h.header.key for h in added.response_headers.response.header_mutation.set_headers]
        assert "x-request-id" in keys
        await q.put(body(b'data: {"choices": []}\n\n', end=False, response=True))
        echoed = await call.read()
        assert (
            echoed.response_body.response.body_mutation.streamed_response.body == b'data: {"choices": []}\n\n'
        )
        assert state.backends[idx].running == 1  # first token marked
        await q.put(body(usage + b"data: [DONE]\n\n", end=True, response=True))
        await call.read()
        await q.put(None)
        assert await eventually(lambda: leases_zero(state))
    assert state.counters.ok == 1 and state.counters.retries == 0
    rec = picked.epp.router.observer.log.latest(1)[0] if picked.epp else None
    assert rec is not None and rec.cached_real == 32 and rec.status == 200 and rec.complete


async def test_health_and_shutdown(tokenizer: Tokenizer) -> None:
    from kvroute.server.cluster import free_port

    dead = BackendSpec(f"http://127.0.0.1:{free_port()}")  # nothing listens: never ready
    cfg = RouterConfig(backends=(dead,), port=0, health_interval_s=0.1, eject_after=1, drain_grace_s=0.0)
    epp = EppServer(cfg, "127.0.0.1", 0, tokenizer=tokenizer)
    await epp.start()
    try:
        async with grpc.aio.insecure_channel(epp.grpc_address) as ch:
            health = health_pb2_grpc.HealthStub(ch)

            async def status(service: str) -> int:
                return (await health.Check(health_pb2.HealthCheckRequest(service=service))).status

            serving, not_serving = (
                health_pb2.HealthCheckResponse.SERVING,
                health_pb2.HealthCheckResponse.NOT_SERVING,
            )
            assert await status("liveness") == serving
            assert await eventually(lambda: not epp.router.state.backends[0].healthy)
            for _ in range(50):
                if await status("readiness") == not_serving:
                    break
                await asyncio.sleep(0.1)
            assert await status("readiness") == not_serving
            assert await status("envoy.service.ext_proc.v3.ExternalProcessor") == not_serving
            epp.extproc.refusing = True  # what the shutdown sets after its grace
            out = await exchange(epp.grpc_port, [headers("/v1/completions"), body(completion("hi"))])
            imm = out[0].immediate_response
            assert imm.status.code == 503 and b"shutting down" in imm.body
    finally:
        await epp.shutdown()
