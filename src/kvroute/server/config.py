"""Router configuration: frozen dataclasses. Units: seconds for every ``*_s`` field, bytes for
``max_body_bytes`` and ``max_response_bytes``, tokens for ``block_size``. Nothing here opens sockets
or files.

The command-line flags and the YAML file that build it are read by :mod:`kvroute.commands.settings`
(``load_config_file``). YAML layout (every key optional except ``backends``)::

    backends:
      - url: http://10.0.0.1:8000
        kv_events: tcp://10.0.0.1:5557        # exact KV view from this engine's ZMQ events
        kv_replay: tcp://10.0.0.1:5558        # optional replay socket for gap recovery
      - http://10.0.0.2:8000                  # a bare URL is also accepted
    policy: lmetric
    host: 127.0.0.1
    port: 8080
    tokenizer: null                           # path to a tokenizer.json (default: bundled Qwen3)
    chat_template: null                       # Jinja file (default: the tokenizer folder's, else ChatML)
    tokenize: exact                           # or defer: see RouterConfig.tokenize
    block_size: 16
    max_body_bytes: 33554432
    max_response_bytes: 268435456             # an engine's answer read whole (not a stream); beyond: a 502
    max_connections: 1024                     # client connections at once; beyond: a JSON 503
    header_timeout_s: 10.0                    # a request's head, from its first byte; then 408, closed
    body_timeout_s: 60.0                      # its whole body, from the end of the head; then 408, closed
    keepalive_timeout_s: 75.0                 # an idle client connection is closed after this
    write_timeout_s: 30.0                     # a client that stops reading: its request is ended
    upstream_keepalive_s: 15.0                # an idle pooled connection to an engine is closed after this
    max_prompt_tokens: 262144                 # when no backend lists max_model_len; beyond: a 400
    parse_offload: process                    # bodies from parse_offload_bytes parsed off the loop
    parse_offload_bytes: 1048576
    scrape_interval_s: 0.05                   # while load moves; up to scrape_idle_interval_s (1.0) idle
    health_interval_s: 1.0
    drain_grace_s: 2.0                        # SIGTERM: /health 503 at once, new requests refused after
    drain_timeout_s: 30.0                     # in-flight requests awaited this long, then ended
    features: {hotspot: true, monitor: true}  # production features, see kvroute.commands.settings
    discover: [dns://engines.default.svc:8000, file:///etc/kvroute/backends.yaml]
    discover_interval_s: 5.0                  # DNS re-resolved / file's mtime checked this often
    discover_kv_events: tcp://{host}:5557     # discovered backends' KV events (absent: approximate)
    admin_token: null                         # the admin API's bearer token (prefer the env variable)
    peer_bind: tcp://0.0.0.0:5600             # router replicas: receive the others' reservations here
    peers: [dns://kvroute-peers:5600]         # ... and announce ours to these (tcp:// or dns://)
    peer_expiry_s: 3.0                        # a silent peer's reservations vanish after this
    peer_refresh_s: 1.0                       # each replica re-announces its whole load this often
    workers: 1                                # `kvroute serve` processes sharing the port (SO_REUSEPORT)
    worker_start_timeout_s: 120.0             # each worker must listen within this, else serve fails
    explain: false                            # every response carries x-kvroute-* explanation headers
    decisions_kept: 1000                      # decision records kept for GET /debug/decisions
    access_log: null                          # JSON lines access log: a file path, or - for stdout
    record: null                              # the routed traffic as a replayable trace (kvroute sim --trace)
    shadow: [vllm, round-robin]               # shadow policies, computed beside the real one
    otel: false                               # OpenTelemetry traces (the otel extra)
    router_queue: {ttl_s: 30, tick_s: 0}      # the router-side queue (true: on, the default; false: off)
    engine_limits: {max_num_batched_tokens: 8192, max_num_seqs: 256}  # the engines', for the queue
    ...                                       # any other RouterConfig field by name

A backend mapping may carry ``tags: [spot]`` (spot instances, see ``features.limits``), ``models:
[...]`` and ``lora_adapters: [...]`` (what it serves, instead of reading its ``/v1/models``; see
:mod:`kvroute.server.state.pools`) and ``engine: vllm | sglang`` (its metric names; unset: detected, see
:mod:`kvroute.server.sync.engines`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from urllib.parse import urlparse

from kvroute.errors import UserError
from kvroute.features.settings import FeatureConfig
from kvroute.policies.registry import DEFAULT_POLICY
from kvroute.routing.queue import QueueConfig, default_queue

__all__ = [
    "BackendSpec",
    "RouterConfig",
    "netloc",
    "parse_backend_url",
    "parse_peer_endpoint",
    "queue_note",
    "url_text_ok",
]


TOKENIZE_MODES = ("defer", "exact")  # RouterConfig.tokenize
OFFLOAD_MODES = ("process", "thread", "off")  # RouterConfig.parse_offload


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """One OpenAI-compatible engine.

    - ``url``: base URL without a trailing slash, e.g. ``http://127.0.0.1:8000``.
    - ``kv_events``: ZMQ PUB endpoint of the engine's KV events (``tcp://host:port``); None → the
      approximate KV view (routing history) for this backend.
    - ``kv_replay``: ZMQ ROUTER endpoint for replaying missed event batches after a sequence gap.
    - ``tags``: labels of the backend, e.g. ``("spot",)`` (see ``kvroute.features.limits``).
    - ``models``, ``lora_adapters``: the model ids and LoRA adapters it serves (both empty: read from
      its ``/v1/models``); ``engine``: ``"vllm"`` or ``"sglang"`` (None: detected from its metrics).
    - ``role``: ``"prefill"`` or ``"decode"`` in a disaggregated fleet (``kvroute.server.pd``); None:
      a colocated engine.
    """

    url: str
    kv_events: str | None = None
    kv_replay: str | None = None
    tags: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    lora_adapters: tuple[str, ...] = ()
    engine: str | None = None
    role: str | None = None


RELOADABLE: tuple[str, ...] = ("backends", "policy", "features")
"""The :class:`RouterConfig` fields a SIGHUP reload applies to a running router (the others need a
restart): see :meth:`RouterConfig.reloaded`."""


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Everything the router needs; see the module docstring for the YAML form.

    - ``max_retries``: extra attempts on other backends when an attempt fails before its first byte.
    - ``eject_after``: consecutive failed health checks before a backend is ejected (a connection error
      on a request ejects at once); ``readmit_after``: consecutive good checks to re-admit it.
    - ``scrape_stale_s``: scraped engine metrics older than this are ignored in the load view.
    - ``scrape_interval_s``, ``scrape_idle_interval_s``: the scrape interval while the load moves, and
      the longest one while it does not (:mod:`kvroute.server.sync.scrape`; one scraper per machine).
    - ``approx_capacity_blocks``: per-backend capacity of the approximate KV view (0 → use the
      engine's pool size when known, else 16384 blocks); ``approx_ttl_s``: entries older than this
      are dropped.
    - ``kv_recovery_s``: after an unrecovered event gap the backend's exact view is cleared and the
      approximate view is used (merged with new events) for this long.
    - ``tokenizer_cache_entries``: per-message token cache size (messages); ``tokenizer_cache_tokens``:
      the most token ids it holds in all (about 40 bytes each; the block-hash memo has the same bound).
    - ``chat_template``: a Jinja chat template file (see :mod:`kvroute.chat_template`); by default
      the tokenizer folder's own template, else ChatML.
    - ``tokenize``: ``"exact"`` (default) tokenizes the whole prompt before routing. ``"defer"``
      routes a request with much text the router has not tokenized before (``proxy.DEFER_CHARS``
      characters or more after its cached leading messages/segments) on the token blocks it knows
      plus an estimate of the rest's token count, and tokenizes the rest once the request is on its
      way (then corrects the KV view and the queued-prefill counter). New text is only cached on a
      backend if another path put it there (another router replica, direct traffic), which ``defer``
      cannot see. The new text is tokenized once the first byte has been relayed, or after
      ``proxy.TAIL_GRACE_S`` without one. With the tiktoken encoder (:mod:`kvroute.fastbpe`)
      tokenizing new text costs well under a millisecond per prompt; on the proxy benchmark (2 cores
      shared by the router, the client and 4 engines, where the deferred work still competes for the
      same cores) ``defer`` was at most 0.4 ms faster than ``exact``. It is opt-in because of what it
      cannot see.
      The production features (``features``) always tokenize exactly.
    - ``drain_grace_s``, ``drain_timeout_s``: graceful shutdown (SIGTERM/SIGINT, see
      :meth:`kvroute.server.app.RouterServer.shutdown`): ``/health`` answers 503 at once; new requests
      are still served for ``drain_grace_s`` seconds (so a load balancer sees the 503 first), then
      refused (503) and the listening socket is closed; requests in flight are awaited for up to
      ``drain_timeout_s`` seconds more, then ended (a stream with an SSE error event).
    - ``admin_token``: the bearer token of the admin API (``/admin/backends``, see
      :mod:`kvroute.server.sync.admin`); None: the admin API is off (its routes are not registered). Not
      shown in ``repr``.
    - ``discover``: discovery sources, ``dns://NAME:PORT`` or ``file://PATH`` (see
      :mod:`kvroute.server.sync.discovery`), checked every ``discover_interval_s`` seconds; the backends
      they list join ``backends`` (which discovery never removes). ``discover_kv_events``: the KV event
      endpoint of a DNS-discovered backend, a template with ``{host}`` (None: approximate view). In a
      P/D fleet a source takes a role, ``prefill=dns://...`` or ``decode=...`` (``kvroute.server.pd``).
    - ``models_interval_s``: how often each backend's ``/v1/models`` is read again (model pools).
    - ``peer_bind``, ``peers``, ``peer_expiry_s``, ``peer_refresh_s``: router replicas that share their
      reservations (:mod:`kvroute.server.sync.peers`): receive the other replicas' at ``peer_bind``
      (``tcp://HOST:PORT``), announce this one's to ``peers`` (``tcp://HOST:PORT`` or
      ``dns://NAME:PORT``, every address of NAME); a re-announcement every ``peer_refresh_s`` seconds
      heals lost messages, a peer silent for ``peer_expiry_s`` seconds is forgotten.
    - Limits on clients (each client connection; see :mod:`kvroute.server.wire.limits`):
      ``max_connections`` client connections at once per router process (each ``--workers`` worker
      has its own); a connection beyond it is answered a JSON 503 (``Retry-After``) and closed.
      ``header_timeout_s``: a request's head (request line and headers) must be complete this many
      seconds after its first byte, else a JSON 408 and the connection is closed.
      ``body_timeout_s``: its whole body must arrive within this many seconds of the head, else a
      JSON 408 and the connection is closed. ``keepalive_timeout_s``: a connection with no request
      in progress and no byte of the next one (from its opening, or from the end of the last
      response) is closed after this many seconds. ``write_timeout_s``: a write to the client that
      cannot complete for this many seconds (the client stopped reading its stream) ends the
      request: the engine's request is aborted (its upstream connection is closed), the lease is
      released and the client's connection is closed; the last writes of a whole (buffered)
      answer get as long, then the connection is closed.
    - ``max_response_bytes``: the largest answer of an engine that the router reads whole (a
      non-streamed completion, an error body; never a stream, which is relayed as it comes): one
      that grows past it is not read further, its connection is aborted and the client gets a JSON
      502, so an engine cannot make the router hold an unbounded body in memory.
    - ``upstream_keepalive_s``: a pooled keep-alive connection to an engine that has carried no
      request for this many seconds is closed (checked every 50 ms; an engine without an idle timeout
      of its own would otherwise keep it open for ever).
    - ``max_prompt_tokens``: the longest prompt (tokens) routed when no backend's ``/v1/models``
      lists a ``max_model_len``; when some do, the largest of theirs minus one is the cap (vLLM
      refuses a prompt of ``max_model_len`` tokens or more). A longer prompt is a 400, checked
      before its blocks are hashed (token ids: before they are checked one by one).
    - ``parse_offload``, ``parse_offload_bytes``: a request body of at least ``parse_offload_bytes``
      bytes is parsed and checked off the event loop: ``"process"`` (default) in a worker process
      (JSON parsing holds the GIL, so a thread would still stall the loop), ``"thread"`` on a
      worker thread, ``"off"`` on the loop. A token-id prompt of ``HASH_OFF_TOKENS`` (16,384) tokens
      or more in such a body is chain-hashed there too. See :mod:`kvroute.server.stages.parse`.
    - ``explain``, ``decisions_kept``, ``access_log``, ``shadow``, ``otel``: seeing decisions (see
      :mod:`kvroute.server.observe.observer`): explanation headers on every response, the size of the decision
      ring buffer (``GET /debug/decisions``), the JSON-lines access log (None: off; ``-``: stdout),
      shadow policies (:mod:`kvroute.routing.shadow`) and OpenTelemetry traces
      (:mod:`kvroute.server.observe.tracing`).
    """

    backends: tuple[BackendSpec, ...]
    policy: str = DEFAULT_POLICY
    host: str = "127.0.0.1"
    port: int = 8080
    tokenizer: str | None = None
    chat_template: str | None = None
    block_size: int = 16
    max_body_bytes: int = 32 * 1024 * 1024
    max_response_bytes: int = 256 * 1024 * 1024
    max_connections: int = 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keepalive_timeout_s: float = 75.0
    write_timeout_s: float = 30.0
    upstream_keepalive_s: float = 15.0
    max_prompt_tokens: int = 262144
    parse_offload: str = "process"
    parse_offload_bytes: int = 1024 * 1024
    scrape_interval_s: float = 0.05
    scrape_idle_interval_s: float = 1.0
    scrape_stale_s: float = 1.0
    health_interval_s: float = 1.0
    health_timeout_s: float = 1.0
    eject_after: int = 3
    readmit_after: int = 1
    max_retries: int = 2
    connect_timeout_s: float = 2.0
    upstream_timeout_s: float = 600.0
    approx_capacity_blocks: int = 0
    approx_ttl_s: float = 600.0
    kv_recovery_s: float = 30.0
    tokenizer_cache_entries: int = 65536
    tokenizer_cache_tokens: int = 2_000_000
    tokenize: str = "exact"
    retry_after_s: int = 1
    drain_grace_s: float = 2.0
    drain_timeout_s: float = 30.0
    features: FeatureConfig | None = None  # production features (kvroute.features); None: all off
    admin_token: str | None = field(default=None, repr=False)
    discover: tuple[str, ...] = ()
    discover_interval_s: float = 5.0
    discover_kv_events: str | None = None
    peer_bind: str | None = None
    peers: tuple[str, ...] = ()
    peer_expiry_s: float = 3.0
    peer_refresh_s: float = 1.0
    models_interval_s: float = 10.0
    workers: int = 1  # `kvroute serve` processes on the port (kvroute.server.workers); 1: this process
    worker_start_timeout_s: float = 120.0  # with workers > 1: each must listen within this, else an error
    explain: bool = False
    decisions_kept: int = 1000
    access_log: str | None = None
    record: str | None = None  # --record FILE (kvroute.server.observe.recording); one writer: workers == 1
    shadow: tuple[str, ...] = ()
    otel: bool = False
    # the router-side queue (kvroute.routing.queue; on by default, None: off); it holds a request back
    # only where engine_limits are known, else it never does
    router_queue: QueueConfig | None = field(default_factory=default_queue)
    engine_limits: tuple[int, int] = (0, 0)  # the engines' (max_num_batched_tokens, max_num_seqs); 0: unknown

    def reloaded(self, new: RouterConfig) -> RouterConfig:
        """This config with ``new``'s :data:`RELOADABLE` fields: what a router started with this
        config runs after a SIGHUP reload of ``new`` (the other fields keep their values)."""
        return dataclasses.replace(self, **{f: getattr(new, f) for f in RELOADABLE})

    def validate(self) -> RouterConfig:
        """Return self; raise :class:`UserError` for a value out of range."""
        if self.router_queue is not None:
            self.router_queue.check()
        if any(x < 0 for x in self.engine_limits):
            raise UserError("config: engine limits must be >= 0")
        if not self.backends and not self.discover:
            raise UserError(
                "at least one backend is needed (--backend URL, 'backends' in the config, or --discover)"
            )
        for src in self.discover:
            src = src.removeprefix("prefill=").removeprefix("decode=")  # a role: P/D mode
            if not src.startswith(("dns://", "file://")):
                raise UserError(f"config: discover {src!r} must be dns://NAME:PORT or file://PATH")
        if self.discover_kv_events is not None and not self.discover_kv_events.startswith(
            ("tcp://", "ipc://")
        ):
            raise UserError(
                f"config: discover_kv_events={self.discover_kv_events!r} must be a tcp:// template"
            )
        if self.record is not None and self.workers > 1:
            raise UserError(
                "config: record needs workers: 1 (each worker would write its own trace into one file)"
            )
        if self.admin_token is not None and not self.admin_token.strip():
            raise UserError("config: admin_token must not be empty")
        for b in self.backends:
            if b.engine is not None and b.engine not in ("vllm", "sglang"):
                raise UserError(f"config: backend {b.url}: engine {b.engine!r} must be vllm or sglang")
        urls = [b.url for b in self.backends]
        if len(set(urls)) != len(urls):
            raise UserError("a backend URL is listed twice")
        checks = [
            ("block_size", self.block_size >= 1),
            ("max_body_bytes", self.max_body_bytes >= 1024),
            ("max_response_bytes", self.max_response_bytes >= 1024),
            ("scrape_interval_s", self.scrape_interval_s > 0),
            ("scrape_idle_interval_s", self.scrape_idle_interval_s > 0),
            ("health_interval_s", self.health_interval_s > 0),
            ("health_timeout_s", self.health_timeout_s > 0),
            ("eject_after", self.eject_after >= 1),
            ("readmit_after", self.readmit_after >= 1),
            ("max_retries", self.max_retries >= 0),
            ("connect_timeout_s", self.connect_timeout_s > 0),
            ("upstream_timeout_s", self.upstream_timeout_s > 0),
            ("approx_capacity_blocks", self.approx_capacity_blocks >= 0),
            ("approx_ttl_s", self.approx_ttl_s > 0),
            ("kv_recovery_s", self.kv_recovery_s >= 0),
            ("tokenizer_cache_entries", self.tokenizer_cache_entries >= 0),
            ("tokenizer_cache_tokens", self.tokenizer_cache_tokens >= 0),
            ("port", 0 <= self.port <= 65535),
            ("retry_after_s", self.retry_after_s >= 0),
            ("drain_grace_s", 0 <= self.drain_grace_s < float("inf")),
            ("drain_timeout_s", 0 <= self.drain_timeout_s < float("inf")),
            ("discover_interval_s", 0 < self.discover_interval_s < float("inf")),
            ("workers", 1 <= self.workers <= 256),
            ("worker_start_timeout_s", 0 < self.worker_start_timeout_s < float("inf")),
            ("decisions_kept", 1 <= self.decisions_kept <= 1_000_000),
            ("models_interval_s", 0 < self.models_interval_s < float("inf")),
            ("max_connections", 1 <= self.max_connections <= 1_000_000),
            ("header_timeout_s", 0 < self.header_timeout_s < float("inf")),
            ("body_timeout_s", 0 < self.body_timeout_s < float("inf")),
            ("keepalive_timeout_s", 0 < self.keepalive_timeout_s < float("inf")),
            ("upstream_keepalive_s", 0 < self.upstream_keepalive_s < float("inf")),
            ("write_timeout_s", 0 < self.write_timeout_s < float("inf")),
            ("max_prompt_tokens", self.max_prompt_tokens >= 1),
            ("parse_offload_bytes", self.parse_offload_bytes >= 0),
        ]
        for name, ok in checks:
            if not ok:
                raise UserError(f"config: {name}={getattr(self, name)!r} is out of range")
        self._validate_peers()
        if self.shadow:
            from kvroute.routing.shadow import parse_shadow_names

            parse_shadow_names(self.shadow)
        if self.parse_offload not in OFFLOAD_MODES:
            raise UserError(
                f"config: parse_offload={self.parse_offload!r} must be one of {', '.join(OFFLOAD_MODES)}"
            )
        if self.tokenize not in TOKENIZE_MODES:
            raise UserError(f"config: tokenize={self.tokenize!r} must be one of {', '.join(TOKENIZE_MODES)}")
        return self

    def _validate_peers(self) -> None:
        if self.peer_bind is not None:
            parse_peer_endpoint(self.peer_bind, dns=False)
        for p in self.peers:
            parse_peer_endpoint(p)
        if not 0 < self.peer_refresh_s < float("inf"):
            raise UserError(f"config: peer_refresh_s={self.peer_refresh_s!r} must be > 0 seconds")
        if not self.peer_refresh_s < self.peer_expiry_s < float("inf"):
            raise UserError(
                f"config: peer_expiry_s={self.peer_expiry_s!r} must be longer than "
                f"peer_refresh_s={self.peer_refresh_s!r} (3 refreshes or more is wise)"
            )


def parse_backend_url(url: str) -> str:
    """Normalise a backend base URL (strip trailing ``/`` and a trailing ``/v1``; scheme and host in
    lower case, so that one engine has one URL whichever way it was written); raise UserError if it
    is not ``http(s)://host[:port][/path]`` in printable ASCII without spaces, with a port in
    1..65535 and no query or fragment."""
    u = url.strip().rstrip("/")
    if u.endswith("/v1"):
        u = u[: -len("/v1")]
    bad = UserError(f"backend URL {url!r} must look like http://host:port")
    if not url_text_ok(u) or "?" in u or "#" in u:
        raise bad
    parsed = urlparse(u)
    try:
        port = parsed.port
    except ValueError:
        raise bad from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname or port == 0:
        raise bad
    if parsed.username is None and parsed.password is None:
        parsed = parsed._replace(netloc=netloc(parsed.hostname, port))
    return parsed.geturl()


def url_text_ok(text: str) -> bool:
    """Whether ``text`` may be a URL here: printable ASCII without spaces (no control character
    can reach a log line or a request line through it)."""
    return text.isascii() and text.isprintable() and not any(c.isspace() for c in text)


def netloc(host: str, port: int | None) -> str:
    """``host[:port]`` as a URL writes it (an IPv6 address in brackets): with the host as
    ``urlparse`` gives it (lower case), one engine has one URL whichever way it was written."""
    where = f"[{host}]" if ":" in host else host
    return where if port is None else f"{where}:{port}"


def parse_peer_endpoint(text: str, dns: bool = True) -> tuple[str, str, int]:
    """``tcp://HOST:PORT`` (or, with ``dns``, ``dns://NAME:PORT``) → (scheme, host, port); raises
    :class:`UserError` otherwise. ``HOST`` may be ``*`` or an IPv6 address in brackets."""
    scheme, sep, rest = text.partition("://")
    schemes = ("tcp", "dns") if dns else ("tcp",)
    want = " or dns://NAME:PORT" if dns else ""
    host, colon, port = rest.rpartition(":")
    if not sep or scheme not in schemes or not colon or not host or not port.isdigit():
        raise UserError(f"peer endpoint {text!r}: expected tcp://HOST:PORT{want}")
    if not 1 <= int(port) <= 65535:
        raise UserError(f"peer endpoint {text!r}: port must be in 1..65535")
    return scheme, host.removeprefix("[").removesuffix("]"), int(port)


def queue_note(config: RouterConfig) -> str:
    """What the start-up line says of the router-side queue: off; on with the engines' limits (it holds
    a request back while its instance is saturated); or on without them (it never holds one back:
    nothing is known to be saturated)."""
    if config.router_queue is None:
        return "router-queue=off"
    tokens, seqs = config.engine_limits
    if not tokens and not seqs:
        return "router-queue=on (idle: engine limits unknown, --engine-max-num-batched-tokens/--engine-max-num-seqs)"
    return f"router-queue=on (engine limits: {tokens or '?'} batched tokens, {seqs or '?'} sequences)"
