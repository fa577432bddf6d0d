"""The emulated vLLM-compatible engine server (aiohttp): one EngineModel under the wall clock.

Endpoints (as vLLM's OpenAI server has them): ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (``stream`` with SSE ``data: {...}`` lines and ``data: [DONE]``,
``stream_options.include_usage``), ``POST /tokenize``, ``POST /detokenize``, ``GET /health``,
``GET /version``, ``GET /metrics`` (Prometheus text, vLLM's names).

LoRA (``lora_modules``, as vLLM's ``--lora-modules NAME=PATH``; only the names matter here): each
adapter is listed by ``/v1/models`` as a model whose ``parent`` is the base model and may be
requested by name; its requests' blocks are hashed with the adapter as extra key (as vLLM does, so
the same tokens under another adapter or the base model are other cache entries), and their
``BlockStored`` events carry ``lora_name`` (and ``lora_id``, 1 for the first adapter, as vLLM numbers
them).

``flavor="sglang"`` presents the engine as SGLang: SGLang's metric names
(:mod:`kvroute.emulator.metrics`), its KV event layout (``kv_events.fmt == "sglang"``: one event per
page of ``kv_events.page_size`` tokens, see :mod:`kvroute.kvevents`), ``owned_by: "sglang"`` in
``/v1/models`` and SGLang's ``GET /get_model_info``. LoRA is not emulated with it (SGLang's KV events
do not name the adapter).

Generation: a request generates exactly ``max_tokens`` tokens (as with ``ignore_eos``; a real model
would also stop at EOS, the filler text has none), one per modelled decode step; the tokens are a
fixed cycle of common English words, decoded by the tokenizer. ``finish_reason`` is ``"length"``.
``usage.prompt_tokens_details.cached_tokens`` is the model's prefix-cache hit at admission.

Prefill/decode roles (``kv_transfer``, vLLM's ``--kv-transfer-config`` with the NIXL connector): see
:mod:`kvroute.emulator.pd`. A request's internal id is ``cmpl-<X-Request-Id>`` (``chatcmpl-`` for chat)
when the client sent one not in use, as vLLM names its requests, so both legs of a P/D request share it.

A client that disconnects aborts its request: the handler is cancelled (``handler_cancellation``)
or its write fails, and the request's blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace
from typing import Any

import orjson
from aiohttp import web

import kvroute
from kvroute.blocks import extra_key, hash_blocks
from kvroute.emulator.driver import EngineDriver
from kvroute.emulator.metrics import CONTENT_TYPE, EngineMetrics
from kvroute.emulator.pd import (
    KVParams,
    KVTransferSettings,
    Leases,
    SideChannel,
    ask,
    parse_kv_transfer_params,
)
from kvroute.emulator.protocol import (
    ApiError,
    GenerateRequest,
    bad,
    chat_prompt_ids,
    check_model,
    chunk,
    full_response,
    parse_chat,
    parse_completion,
    render_body,
    usage,
    usage_chunk,
)
from kvroute.emulator.publisher import KVEventPublisher
from kvroute.engine.model import EngineModel
from kvroute.engine.transfer import TransferModel
from kvroute.engine.types import (
    BlockRemoved,
    BlockStored,
    CostModel,
    EngineConfig,
    EngineOutput,
    EngineRequest,
    KVEvent,
    OutputKind,
)
from kvroute.kvevents import EventFormat
from kvroute.tokenizer import Tokenizer

log = logging.getLogger("kvroute.emulator")

__all__ = ["FILLER_WORDS", "EmulatorServer", "EmulatorSettings", "KVEventsSettings"]

log = logging.getLogger("kvroute.emulator")

FILLER_WORDS = (
    *("the", "of", "and", "to", "in", "is", "that", "it", "for", "on", "with", "as", "was", "by", "at"),
    *("from", "this", "be", "are", "or", "an", "have", "not", "but", "which", "one", "all", "were", "they"),
)


@dataclass(frozen=True, slots=True)
class KVEventsSettings:
    """Where and how KV events are published (see :mod:`kvroute.emulator.publisher`)."""

    endpoint: str
    fmt: EventFormat = "map"  # vLLM 0.10+ (0.32 included) sends maps tagged "type"
    topic: str = ""
    replay_endpoint: str | None = None
    connect: bool = False
    page_size: int = 0  # fmt "sglang": tokens per page (0: the block size)
    buffer_steps: int = 10_000  # batches kept for replay (vLLM's KVEventsConfig.buffer_steps)


@dataclass(frozen=True, slots=True)
class EmulatorSettings:
    """One emulated engine.

    - ``time_scale``: model seconds per wall second (10 = ten times faster than real time).
    - ``default_max_tokens``: output length of a chat request that sets no ``max_tokens``
      (vLLM would fill the context and stop at EOS; the filler has no EOS). Completions default to 16
      as in vLLM.
    - ``engine.max_model_len``: longest prompt + output, in tokens.
    - ``lora_modules``: names of the LoRA adapters served besides ``model_name``.
    - ``flavor``: ``"vllm"`` or ``"sglang"`` (module docstring).
    - ``kv_transfer``: the P/D role (None: no KV connector, ``kv_transfer_params`` ignored as vLLM
      does without one); ``kv_bytes_per_token``: KV bytes per token per rank, for the transfer time.
    - ``metrics_name_filter``: honour ``/metrics?name[]=`` (prometheus_client's filter). Off by
      default, as vLLM 0.32: its ``/metrics`` route comes from the instrumentator, registered before
      the app that filters, so every scrape renders the whole page.
    """

    model_name: str = "kvroute-emulated"
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(report_tokens=True))
    time_scale: float = 1.0
    default_max_tokens: int = 256
    kv_events: KVEventsSettings | None = None
    lora_modules: tuple[str, ...] = ()
    flavor: str = "vllm"
    kv_transfer: KVTransferSettings | None = None
    kv_bytes_per_token: float = 0.0
    metrics_name_filter: bool = False


FULL_ATTENTION = "full_attention"
"""vLLM's ``KVCacheSpecKind`` of a full-attention KV cache group (what its ``BlockStored`` carries)."""


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """Every response carries the request's ``X-Request-Id`` (a new random one when it had none),
    as vLLM's with ``--enable-request-id-headers``: a router can tell a stray response from the
    answer to its request by it."""
    response.headers["X-Request-Id"] = request.headers.get("X-Request-Id") or uuid.uuid4().hex


class EmulatorServer:
    """An aiohttp app around one engine model. ``await start(host, port)`` (port 0: any free one;
    the bound port is then in ``port``), ``await stop()``. ``model``/``driver`` are exposed for
    tests and tools; mutate them only from the loop's thread."""

    def __init__(self, settings: EmulatorSettings, cost: CostModel, tokenizer: Tokenizer) -> None:
        engine = settings.engine
        if not engine.report_tokens:
            engine = replace(engine, report_tokens=True)
        self.settings = settings
        self.engine_config = engine
        self.tokenizer = tokenizer
        if settings.flavor not in ("vllm", "sglang"):
            raise ValueError(f"flavor must be vllm or sglang, not {settings.flavor!r}")
        if settings.flavor == "sglang" and settings.lora_modules:
            raise ValueError("LoRA adapters are not emulated with flavor sglang")
        self.model = EngineModel(engine, cost)
        self.metrics = EngineMetrics(
            settings.model_name,
            self.model.stats,
            settings.flavor,
            engine.block_size,
            external=settings.kv_transfer is not None,
        )
        self.served = (settings.model_name, *settings.lora_modules)  # base model first
        self._lora_ids = {name: i + 1 for i, name in enumerate(settings.lora_modules)}
        self._adapter_blocks: dict[int, str] = {}  # block hash -> adapter of the request that hashed it
        self._claimed: set[str] = set()  # request ids handed out and not yet answered
        self._salted: dict[int, str] = {}  # first block hash of a salted prompt -> its cache_salt
        self.publisher: KVEventPublisher | None = None
        if settings.kv_events is not None:
            kv = settings.kv_events
            pages = 1
            if kv.fmt == "sglang" and kv.page_size:
                if engine.block_size % kv.page_size:
                    raise ValueError(
                        f"page size {kv.page_size} must divide the block size {engine.block_size}"
                    )
                pages = engine.block_size // kv.page_size
            self.publisher = KVEventPublisher(
                kv.endpoint,
                fmt=kv.fmt,
                topic=kv.topic,
                replay_endpoint=kv.replay_endpoint,
                connect=kv.connect,
                pages_per_block=pages,
                buffer_steps=kv.buffer_steps,
            )
        pub = self.publisher
        self.driver = EngineDriver(
            self.model,
            settings.time_scale,
            metrics=self.metrics,
            publish=(lambda events: pub.publish(self._tag(events))) if pub is not None else None,
        )
        kt = settings.kv_transfer
        self.kv_transfer = kt
        self.transfer: TransferModel | None = None
        self.leases: Leases | None = None
        self.side: SideChannel | None = None
        self._side_ctx: Any = None  # D: zmq.asyncio.Context for side-channel requests
        self._notifies: set[asyncio.Task[Any]] = set()
        if kt is not None:
            if settings.flavor != "vllm":
                raise ValueError("a KV transfer role is emulated with flavor vllm only")
            self.transfer = TransferModel.from_gbps(
                settings.kv_bytes_per_token, kt.bandwidth_gbps, kt.latency_s
            )
            if kt.produces:
                self.leases = Leases(lambda rid: self.driver.release(rid), kt.lease_timeout_s)
                self.side = SideChannel(kt.side_host, kt.side_port, self.model.held, self.leases.end)
        self._filler = [tokenizer.encode(" " + w)[0] for w in FILLER_WORDS]
        self._filler_text = [tokenizer.decode([t]) for t in self._filler]
        self._created = int(time.time())
        self.app = self._build_app()
        self._runner: web.AppRunner | None = None
        self.port: int | None = None
        self.disconnects = 0  # streams whose client went away before their end (one debug line each)

    # -- lifecycle -----------------------------------------------------------------------------
    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.on_response_prepare.append(_echo_request_id)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions/render", self.render_completion)
        app.router.add_post("/v1/chat/completions/render", self.render_chat)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/health", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_get("/metrics", self.metrics_endpoint)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        if self.settings.flavor == "sglang":
            app.router.add_get("/get_model_info", self.model_info)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Open the KV event sockets, start the model's clock and listen. Returns the bound port."""
        if self.publisher is not None:
            self.publisher.start()
        if self.side is not None:
            self.side.start()
        if self.kv_transfer is not None and self.kv_transfer.consumes:
            import zmq.asyncio

            self._side_ctx = zmq.asyncio.Context()
        self.driver.start()
        runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        self._runner = runner
        addrs = runner.addresses
        self.port = int(addrs[0][1]) if addrs else port
        return self.port

    async def stop(self) -> None:
        """Stop listening, stop the clock, close the KV event sockets."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.driver.stop()
        if self.publisher is not None:
            await self.publisher.close()
        for task in list(self._notifies):
            task.cancel()
        if self.leases is not None:
            self.leases.close()
        if self.side is not None:
            await self.side.close()
        if self._side_ctx is not None:
            self._side_ctx.destroy(linger=0)
            self._side_ctx = None

    # -- simple endpoints ----------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": kvroute.__version__, "server": "kvroute-emulator"})

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        names = request.query.getall("name[]", []) if self.settings.metrics_name_filter else ()
        return web.Response(body=self.metrics.render(names), headers={"Content-Type": CONTENT_TYPE})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /reset_prefix_cache`` (there behind ``VLLM_SERVER_DEV_MODE=1``; always served
        here): the prefix cache is dropped now (refused, and logged, while a running request holds
        cached blocks, as vLLM), and ``AllBlocksCleared`` goes out with the engine's next step, as
        vLLM publishes it: until a request makes the engine step, subscribers have not seen it."""
        if not self.model.reset_prefix_cache():
            log.warning("failed to reset the prefix cache: running requests still hold cached blocks")
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        name = self.settings.model_name
        cards: list[dict[str, Any]] = [
            {
                "id": mid,
                "object": "model",
                "created": self._created,
                "owned_by": self.settings.flavor,
                "root": mid if mid == name else f"/adapters/{mid}",
                "parent": None if mid == name else name,
                "max_model_len": self.engine_config.max_model_len,
                "permission": [],
            }
            for mid in self.served
        ]
        return web.json_response({"object": "list", "data": cards})

    async def model_info(self, request: web.Request) -> web.Response:
        """SGLang's ``GET /get_model_info``."""
        name = self.settings.model_name
        return web.json_response({"model_path": name, "tokenizer_path": name, "is_generation": True})

    def _tag(self, events: list[KVEvent]) -> list[KVEvent]:
        """What vLLM 0.32 adds to a ``BlockStored``: ``extra_keys`` (one entry per block: the
        adapter's name in each block of an adapter request, then a salted prompt's ``cache_salt`` in
        its first block; None for a block with neither), ``group_idx`` 0, ``kv_cache_spec_kind``
        ``"full_attention"`` (one full-attention KV cache group, as vLLM's for Qwen3) and, for adapter blocks,
        ``lora_id``/``lora_name``. Forgets removed blocks."""
        blocks, salted = self._adapter_blocks, self._salted
        out: list[KVEvent] = []
        for ev in events:
            if isinstance(ev, BlockStored) and ev.block_hashes:
                name = blocks.get(ev.block_hashes[0])
                salt = salted.get(ev.block_hashes[0]) if ev.parent_block_hash is None else None
                keys: list[tuple[object, ...] | None] = [(name,) if name else None] * len(ev.block_hashes)
                if salt is not None:
                    keys[0] = (name, salt) if name else (salt,)
                ev = replace(ev, extra_keys=tuple(keys), group_idx=0, kv_cache_spec_kind=FULL_ATTENTION)
                if name is not None:
                    ev = replace(ev, lora_id=self._lora_ids[name], lora_name=name)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    blocks.pop(h, None)
                    salted.pop(h, None)
            out.append(ev)
        return out

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            if not isinstance(body, dict):
                raise bad("request body must be a JSON object")
            check_model(body, self.served)
            tok = self.tokenizer
            if "messages" in body:
                ids = list(chat_prompt_ids(body, tok))
            else:
                prompt = body.get("prompt")
                if not isinstance(prompt, str):
                    raise bad("'prompt' (a string) or 'messages' is required", "prompt")
                ids = tok.encode(prompt)
            result: dict[str, Any] = {
                "count": len(ids),
                "max_model_len": self.engine_config.max_model_len,
                "tokens": ids,
                "token_strs": None,
            }
            if body.get("return_token_strs"):
                result["token_strs"] = [tok.decode([i]) for i in ids]
            return web.json_response(result)
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)

    async def detokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            if not isinstance(body, dict):
                raise bad("request body must be a JSON object")
            check_model(body, self.served)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or any(
                isinstance(t, bool) or not isinstance(t, int) for t in tokens
            ):
                raise bad("'tokens' must be an array of integers", "tokens")
            try:
                text = self.tokenizer.decode(tokens)
            except ValueError as exc:
                raise bad(str(exc), "tokens") from None
            return web.json_response({"prompt": text})
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)

    # -- generation ----------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._json(request)
            req = parse_completion(body, self.tokenizer, self.served, self.engine_config.max_model_len)
            kvp = self._kv_params(body)
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)
        return await self._generate(request, req, self._request_id(request, "cmpl"), kvp)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._json(request)
            req = parse_chat(
                body,
                self.tokenizer,
                self.served,
                self.engine_config.max_model_len,
                self.settings.default_max_tokens,
            )
            kvp = self._kv_params(body)
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)
        return await self._generate(request, req, self._request_id(request, "chatcmpl"), kvp)

    def _request_id(self, request: web.Request, prefix: str) -> str:
        """``<prefix>-<X-Request-Id>`` when usable and not in use, else ``<prefix>-<random hex>``."""
        xrid = request.headers.get("X-Request-Id", "")
        rid = f"{prefix}-{uuid.uuid4().hex}"
        if xrid and len(xrid) <= 256 and xrid.isprintable():
            mine = f"{prefix}-{xrid}"
            if not self.driver.known(mine) and mine not in self._claimed:
                rid = mine
        self._claimed.add(rid)  # until its handler ends: a D leg submits only after P's blocks are read
        return rid

    def _kv_params(self, body: Any) -> KVParams:
        """The request's P/D role; ApiError 400 when this engine's ``kv_role`` cannot play it."""
        kt = self.kv_transfer
        if kt is None:
            return KVParams()  # no connector: vLLM ignores kv_transfer_params
        kvp = parse_kv_transfer_params(body)
        if kvp.remote_decode and not kt.produces:
            raise bad(
                f"this engine's kv_role is {kt.role}: it cannot prefill for a remote decode",
                "kv_transfer_params",
            )
        if kvp.prefill is not None and not kt.consumes:
            raise bad(
                f"this engine's kv_role is {kt.role}: it cannot decode a remote prefill", "kv_transfer_params"
            )
        return kvp

    async def render_chat(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /v1/chat/completions/render``: the chat body validated and rendered to token
        ids (no generation, nothing enters the engine)."""
        try:
            body = await self._json(request)
            req = parse_chat(
                body,
                self.tokenizer,
                self.served,
                self.engine_config.max_model_len,
                self.settings.default_max_tokens,
            )
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)
        return web.json_response(render_body(req, body, f"chatcmpl-{uuid.uuid4().hex}"))

    async def render_completion(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /v1/completions/render`` (see :meth:`render_chat`)."""
        try:
            body = await self._json(request)
            req = parse_completion(body, self.tokenizer, self.served, self.engine_config.max_model_len)
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)
        return web.json_response(render_body(req, body, f"cmpl-{uuid.uuid4().hex}"))

    async def _json(self, request: web.Request) -> Any:
        raw = await request.read()
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise bad(f"Invalid JSON in request body: {exc}") from None

    def _engine_request(
        self, rid: str, req: GenerateRequest, remote_prefill: bool = False, hold: bool = False
    ) -> EngineRequest:
        bs = self.engine_config.block_size
        adapter = req.model if req.model in self._lora_ids else None
        hashes: list[int] = []
        if self.engine_config.enable_prefix_caching:
            hashes = hash_blocks(req.prompt_ids, bs, extra_key(adapter, req.cache_salt))
            if adapter is not None:
                self._adapter_blocks.update(dict.fromkeys(hashes, adapter))
            if req.cache_salt is not None and hashes:
                self._salted[hashes[0]] = req.cache_salt
        return EngineRequest(
            rid, len(req.prompt_ids), req.max_tokens, tuple(hashes), req.prompt_ids, remote_prefill, hold
        )

    def _filler_ids(self, start: int, stop: int) -> list[int]:
        f = self._filler
        return [f[i % len(f)] for i in range(start, stop)]

    async def _remote_read(self, rid: str, req: GenerateRequest, kvp: KVParams) -> bool:
        """D: read P's blocks (side-channel ``read``, the modelled transfer time, ``done``); True when
        the request may then run with ``remote_prefill``. P is notified even if this is cancelled
        (the client went away) after a successful ``read``."""
        remote = kvp.prefill
        assert remote is not None and self.transfer is not None
        ctx = self._side_ctx
        remote_rid = remote.request_id or rid
        ok, _ = await ask(ctx, remote.host, remote.port, "read", remote_rid)
        if not ok:
            return False  # P has no such blocks (lease expired, P gone): recompute here
        notified = False
        try:
            hashes = self._engine_request(rid, req).block_hashes
            lacking = len(req.prompt_ids) - self.model.local_hit_tokens(hashes, len(req.prompt_ids))
            await asyncio.sleep(self.transfer.seconds(lacking) / self.settings.time_scale)
            notified = True
            await ask(ctx, remote.host, remote.port, "done", remote_rid)
        finally:
            if not notified:  # cancelled mid-transfer: P must still free its blocks
                task = asyncio.get_running_loop().create_task(
                    ask(ctx, remote.host, remote.port, "done", remote_rid)
                )
                self._notifies.add(task)
                task.add_done_callback(self._notifies.discard)
        return True

    async def _outputs(
        self, rid: str, req: GenerateRequest, kvp: KVParams
    ) -> AsyncGenerator[tuple[int, int, bool], None]:
        """Submit the request and yield ``(tokens so far, cached prompt tokens, finished)`` per output
        that adds tokens. Aborts the request if the consumer stops early (disconnect, cancel).
        A D leg first reads P's blocks (:meth:`_remote_read`); a P leg keeps its blocks (``hold``)."""
        remote = kvp.prefill is not None and await self._remote_read(rid, req, kvp)
        queue = self.driver.submit(self._engine_request(rid, req, remote, kvp.remote_decode))
        finished = False
        try:
            cached = 0
            while True:
                out: EngineOutput = await queue.get()
                if out.kind is OutputKind.ABORTED:
                    raise ApiError(500, "the request was aborted by the engine")
                if out.kind is OutputKind.PREEMPTED:
                    continue
                if out.kind is OutputKind.FIRST_TOKEN:
                    cached = out.num_cached_tokens
                finished = out.kind is OutputKind.FINISHED
                yield out.num_output_tokens, cached, finished
                if finished:
                    return
        finally:
            if not finished:
                self.driver.abort(rid)
                self.driver.release(rid)  # a P leg that finished unseen: free, as vLLM on abort

    def _transfer_params(self, rid: str, prompt_tokens: int, cached: int) -> dict[str, Any] | None:
        """P, after its request finished: grant the lease and describe the blocks for D (vLLM's
        ``request_finished`` answer), or None when nothing is held (no full block computed...)."""
        kt, side, leases = self.kv_transfer, self.side, self.leases
        if kt is None or side is None or leases is None:
            return None
        n = self.model.held(rid)
        if n <= 0:
            return None
        leases.grant(rid)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(range(n))],  # one KV cache group
            "remote_engine_id": kt.engine_id,
            "remote_request_id": rid,
            "remote_host": side.host,
            "remote_port": side.port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": prompt_tokens,
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": cached,
        }

    async def _generate(
        self, request: web.Request, req: GenerateRequest, rid: str, kvp: KVParams
    ) -> web.StreamResponse:
        try:
            return await self._answer(request, req, rid, kvp)
        finally:
            self._claimed.discard(rid)

    async def _answer(
        self, request: web.Request, req: GenerateRequest, rid: str, kvp: KVParams
    ) -> web.StreamResponse:
        if req.stream:
            return await self._stream(request, req, rid, kvp)
        created = int(time.time())
        n, cached = 0, 0
        gen = self._outputs(rid, req, kvp)
        try:
            async for progress in gen:
                n, cached = progress[0], progress[1]
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)
        finally:
            await gen.aclose()
        text = self.tokenizer.decode(self._filler_ids(0, n))
        body = full_response(
            req,
            rid,
            created,
            text,
            "length",
            usage(len(req.prompt_ids), n, cached, self.engine_config.block_size, req.kind == "chat"),
        )
        if self.kv_transfer is not None:
            body["kv_transfer_params"] = (
                self._transfer_params(rid, len(req.prompt_ids), cached) if kvp.remote_decode else None
            )
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def _stream(
        self, request: web.Request, req: GenerateRequest, rid: str, kvp: KVParams
    ) -> web.StreamResponse:
        created = int(time.time())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        gen = self._outputs(rid, req, kvp)
        sent, cached = 0, 0
        try:
            if req.kind == "chat":
                await resp.write(_sse(chunk(req, rid, created, None, None, first=True)))
            async for n, cached_now, _finished in gen:
                cached = cached_now
                for i in range(sent, n):
                    text = self._filler_text[i % len(self._filler)]
                    last = i == req.max_tokens - 1  # exactly max_tokens are generated
                    await resp.write(_sse(chunk(req, rid, created, text, "length" if last else None)))
                sent = n
            if kvp.remote_decode:  # a streamed P leg: the lease runs, nobody learns its params
                self._transfer_params(rid, len(req.prompt_ids), cached)
            if req.include_usage:
                await resp.write(
                    _sse(
                        usage_chunk(
                            req,
                            rid,
                            created,
                            usage(
                                len(req.prompt_ids),
                                sent,
                                cached,
                                self.engine_config.block_size,
                                req.kind == "chat",
                            ),
                        )
                    )
                )
            await resp.write(b"data: [DONE]\n\n")
        except ApiError as exc:
            with contextlib.suppress(ConnectionError):
                await resp.write(_sse(exc.body()))
                await resp.write(b"data: [DONE]\n\n")
        except (ConnectionError, asyncio.CancelledError) as exc:
            await gen.aclose()  # aborts the request and frees its blocks
            self.disconnects += 1  # an ordinary event: counted, one debug line, no traceback
            log.debug("request %s: client went away after %d tokens (%s)", rid, sent, type(exc).__name__)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return resp
        finally:
            await gen.aclose()
        with contextlib.suppress(ConnectionError):
            await resp.write_eof()
        return resp
