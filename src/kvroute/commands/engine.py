"""`kvroute engine`: an emulated vLLM-compatible engine server (OpenAI API, /metrics, ZMQ KV events)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from dataclasses import replace
from typing import TYPE_CHECKING

from kvroute.commands import port_number
from kvroute.errors import UserError

if TYPE_CHECKING:
    from kvroute.emulator.pd import KVTransferSettings
    from kvroute.emulator.server import EmulatorSettings
    from kvroute.engine.cost import Profile
    from kvroute.tokenizer import Tokenizer

HELP = (
    "run an emulated vLLM-compatible (or SGLang-flavoured) engine "
    "(same engine model as the simulator, on the wall clock)"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8000, help="HTTP port (default 8000)")
    p.add_argument(
        "--model",
        "--served-model-name",
        dest="model",
        default="kvroute-emulated",
        help="served model name (default kvroute-emulated)",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="model seconds per wall second: 10 runs the model ten times faster (default 1)",
    )
    p.add_argument("--profile", default=None, help="named cost profile (see `kvroute profiles`)")
    p.add_argument("--profile-dir", default=None, help="an LLMServingSim profile folder instead of --profile")
    p.add_argument("--tp", type=int, default=1, help="tensor parallelism for --profile-dir (default 1)")
    p.add_argument("--model-config", metavar="FILE", help="the model's HF config.json for --profile-dir")
    p.add_argument("--max-num-seqs", type=int, default=256, help="running batch limit (default 256)")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=4096,
        help="tokens per step, chunked prefill (default 4096)",
    )
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        help="KV cache capacity in blocks (default: from the profile's GPU memory and model)",
    )
    p.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=None,
        help="GPU memory in GiB for the KV capacity (default: the profile's GPU)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="share of GPU memory vLLM may use (default 0.9)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + output in tokens (default: KV capacity, at most 262144)",
    )
    p.add_argument(
        "--no-enable-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="disable prefix caching",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer.json or a folder holding one (default: bundled Qwen3 tokenizer)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="Jinja chat template (default: the tokenizer folder's own, else ChatML)",
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=256,
        help="output tokens of a chat request without max_tokens (default 256)",
    )
    p.add_argument(
        "--kv-events-endpoint",
        default=None,
        help="publish KV events on this ZMQ endpoint, e.g. tcp://127.0.0.1:5557 (bound)",
    )
    p.add_argument(
        "--kv-events-format",
        choices=["array", "map", "sglang"],
        default=None,
        help="event encoding: array (older vLLM), map (newer) or sglang "
        "(default: map, as vLLM 0.32 sends; sglang with --flavor sglang)",
    )
    p.add_argument(
        "--kv-events-page-size",
        type=int,
        default=None,
        help="with SGLang's event encoding: tokens per page, one event each; divides --block-size "
        "(default: the block size; SGLang's own default page size is 1)",
    )
    p.add_argument(
        "--flavor",
        choices=["vllm", "sglang"],
        default="vllm",
        help="present the engine as vLLM or as SGLang (metric names, KV event layout) (default vllm)",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters served as models besides --model, as vLLM's flag (only NAME matters here)",
    )
    p.add_argument(
        "--kv-events-buffer-steps",
        type=int,
        default=10_000,
        help="event batches kept for replay, as vLLM's KVEventsConfig.buffer_steps (default 10000)",
    )
    p.add_argument(
        "--metrics-name-filter",
        action="store_true",
        help="honour /metrics?name[]= filters (vLLM 0.32 ignores them and renders the whole page; "
        "so does this engine by default)",
    )
    p.add_argument("--kv-events-topic", default="", help="ZMQ topic (default empty)")
    p.add_argument("--kv-events-replay-endpoint", default=None, help="ZMQ ROUTER endpoint for replay")
    p.add_argument(
        "--kv-events-connect",
        action="store_true",
        help="connect the PUB socket to the endpoint instead of binding it",
    )
    pd = p.add_argument_group("prefill/decode disaggregation (vLLM's NIXL connector, emulated)")
    pd.add_argument(
        "--kv-transfer-config",
        metavar="JSON",
        default=None,
        help='vLLM\'s flag, e.g. \'{"kv_connector":"NixlConnector","kv_role":"kv_both"}\' '
        "(kv_role kv_producer, kv_consumer or kv_both)",
    )
    pd.add_argument(
        "--kv-side-channel-port",
        type=int,
        default=None,
        help="P's side-channel port (default: $VLLM_NIXL_SIDE_CHANNEL_PORT, else any free port)",
    )
    pd.add_argument(
        "--kv-side-channel-host",
        default=None,
        help="P's side-channel address (default: $VLLM_NIXL_SIDE_CHANNEL_HOST, else --host)",
    )
    pd.add_argument(
        "--kv-lease-timeout",
        type=float,
        default=None,
        help="seconds P keeps unread blocks (default: the config's kv_connector_extra_config."
        "kv_lease_duration, else $VLLM_NIXL_ABORT_REQUEST_TIMEOUT (older vLLM), else 30 as vLLM 0.32)",
    )
    pd.add_argument(
        "--kv-transfer-bandwidth",
        type=float,
        default=None,
        help="P-to-D link bandwidth in GB/s for the modelled transfer time (default 25: one 200 Gb/s NIC)",
    )
    pd.add_argument(
        "--kv-transfer-latency",
        type=float,
        default=0.0,
        help="fixed seconds per KV transfer (default 0)",
    )


def _positive(name: str, value: float | int | None) -> None:
    if value is not None and not value > 0:
        raise UserError(f"{name} must be positive, got {value}")


def build(args: argparse.Namespace) -> tuple[EmulatorSettings, Profile, Tokenizer]:
    """Settings, cost model and tokenizer from parsed arguments (raises UserError on bad values)."""
    from kvroute.emulator.server import EmulatorSettings, KVEventsSettings
    from kvroute.engine import cost as costmod
    from kvroute.engine.types import EngineConfig
    from kvroute.kvevents import EventFormat
    from kvroute.tokenizer import load_tokenizer

    for name in (
        "time_scale",
        "max_num_seqs",
        "max_num_batched_tokens",
        "kv_blocks",
        "block_size",
        "max_model_len",
        "default_max_tokens",
        "gpu_memory_gib",
        "tp",
    ):
        _positive("--" + name.replace("_", "-"), getattr(args, name))
    if not 0 < args.gpu_memory_utilization <= 1:
        raise UserError("--gpu-memory-utilization must be in (0, 1]")
    if args.profile and args.profile_dir:
        raise UserError("give --profile or --profile-dir, not both")
    if args.model_config and not args.profile_dir:
        raise UserError("--model-config goes with --profile-dir")
    if args.profile_dir:
        profile = costmod.profile_from_dir(args.profile_dir, tp=args.tp, model_config=args.model_config)
    else:
        profile = costmod.get_profile(args.profile or costmod.DEFAULT_PROFILE)
    if args.kv_blocks is not None:
        blocks = args.kv_blocks
    else:
        gpu = profile.gpu
        if args.gpu_memory_gib is not None:
            gpu = replace(gpu, memory_bytes=int(args.gpu_memory_gib * costmod.GIB))
        tokens = costmod.kv_capacity_tokens(
            gpu, profile.model, tp=args.tp, mem_util=args.gpu_memory_utilization
        )
        blocks = tokens // args.block_size
        if blocks <= 0:
            raise UserError(f"no memory left for the KV cache on {gpu.name} with {profile.model.name}")
    capacity = blocks * args.block_size
    max_len = args.max_model_len if args.max_model_len is not None else min(capacity, 262144)
    if max_len > capacity:
        raise UserError(f"--max-model-len {max_len} exceeds the KV cache capacity ({capacity} tokens)")
    engine = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=blocks,
        block_size=args.block_size,
        enable_prefix_caching=args.prefix_caching,
        max_model_len=max_len,
        report_tokens=True,
    )
    fmt: EventFormat = args.kv_events_format or ("sglang" if args.flavor == "sglang" else "map")
    page = args.kv_events_page_size
    if page is not None:
        if fmt != "sglang":
            raise UserError("--kv-events-page-size needs SGLang's event encoding (--flavor sglang)")
        if page < 1 or args.block_size % page:
            raise UserError(f"--kv-events-page-size {page} must divide --block-size {args.block_size}")
    adapters = _lora_names(args.lora_modules, args.model)
    if adapters and args.flavor == "sglang":
        raise UserError(
            "--lora-modules is not emulated with --flavor sglang (its KV events do not name adapters)"
        )
    kv = None
    if args.kv_events_buffer_steps < 1:
        raise UserError("--kv-events-buffer-steps must be >= 1")
    if args.kv_events_endpoint:
        kv = KVEventsSettings(
            args.kv_events_endpoint,
            fmt,
            args.kv_events_topic,
            args.kv_events_replay_endpoint,
            args.kv_events_connect,
            page or 0,
            args.kv_events_buffer_steps,
        )
    settings = EmulatorSettings(
        args.model,
        engine,
        args.time_scale,
        args.default_max_tokens,
        kv,
        lora_modules=adapters,
        flavor=args.flavor,
        kv_transfer=_kv_transfer(args),
        kv_bytes_per_token=profile.model.kv_bytes_per_token_per_rank(args.tp),
        metrics_name_filter=args.metrics_name_filter,
    )
    return settings, profile, load_tokenizer(args.tokenizer, chat_template=args.chat_template)


def _env_number(name: str, kind: type[int] | type[float]) -> int | float | None:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        return kind(raw)
    except ValueError:
        raise UserError(f"${name} must be a number, got {raw!r}") from None


def _kv_transfer(args: argparse.Namespace) -> KVTransferSettings | None:
    """The P/D role from ``--kv-transfer-config`` and its companions (UserError on bad values)."""
    from kvroute.emulator.pd import DEFAULT_LEASE_TIMEOUT_S, KVTransferSettings, parse_kv_transfer_config
    from kvroute.engine.transfer import DEFAULT_BANDWIDTH_GBPS

    extras = ("kv_side_channel_port", "kv_side_channel_host", "kv_lease_timeout", "kv_transfer_bandwidth")
    if args.kv_transfer_config is None:
        given = [n for n in extras if getattr(args, n) is not None]
        if given:
            raise UserError(f"--{given[0].replace('_', '-')} goes with --kv-transfer-config")
        return None
    try:
        connector, role, engine_id, config_lease = parse_kv_transfer_config(args.kv_transfer_config)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    port = args.kv_side_channel_port
    if port is None:
        port = _env_number("VLLM_NIXL_SIDE_CHANNEL_PORT", int) or 0
    if not 0 <= int(port) < 65536:
        raise UserError(f"--kv-side-channel-port {port} is not a port number")
    host = args.kv_side_channel_host or os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST") or args.host
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"  # D must connect somewhere: the loopback of an engine listening everywhere
    lease = args.kv_lease_timeout if args.kv_lease_timeout is not None else config_lease
    if lease is None:
        lease = _env_number("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", float) or DEFAULT_LEASE_TIMEOUT_S
    bandwidth = (
        args.kv_transfer_bandwidth if args.kv_transfer_bandwidth is not None else DEFAULT_BANDWIDTH_GBPS
    )
    _positive("--kv-lease-timeout", lease)
    _positive("--kv-transfer-bandwidth", bandwidth)
    if not args.kv_transfer_latency >= 0:
        raise UserError("--kv-transfer-latency must be >= 0")
    kw = {"engine_id": engine_id} if engine_id else {}
    return KVTransferSettings(
        connector,
        role,
        side_host=host,
        side_port=int(port),
        lease_timeout_s=float(lease),
        bandwidth_gbps=bandwidth,
        latency_s=args.kv_transfer_latency,
        **kw,
    )


def _lora_names(items: list[str], base: str) -> tuple[str, ...]:
    """Adapter names from ``NAME=PATH`` items (vLLM's ``--lora-modules``; a JSON object form is not
    taken); UserError for a malformed or repeated one."""
    names: list[str] = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise UserError(f"--lora-modules {item!r} must look like NAME=PATH")
        name = name.strip()
        if name in names or name == base:
            raise UserError(f"--lora-modules: the name {name!r} is already served")
        names.append(name)
    return tuple(names)


async def _serve(args: argparse.Namespace) -> None:
    import zmq

    from kvroute.emulator.server import EmulatorServer
    from kvroute.server.run import Signals

    settings, profile, tok = build(args)
    server = EmulatorServer(settings, profile.cost, tok)
    try:
        port = await server.start(args.host, args.port)
    except OSError as exc:
        await server.stop()
        raise UserError(f"cannot listen on {args.host}:{args.port}: {exc}") from None
    except zmq.ZMQError as exc:
        await server.stop()
        raise UserError(f"cannot open a ZMQ endpoint (KV events or side channel): {exc}") from None
    # The handlers before the announcement: a signal sent on reading the line stops the engine
    # cleanly (before them, a SIGINT reached asyncio's handler: a KeyboardInterrupt traceback).
    with Signals() as signals:
        e = settings.engine
        print(
            f"kvroute engine: http://{args.host}:{port}/v1 model={settings.model_name} profile={profile.name} "
            f"kv_blocks={e.num_kv_blocks}x{e.block_size} max_model_len={e.max_model_len} "
            f"time_scale={settings.time_scale} flavor={settings.flavor}"
            + (f" lora={','.join(settings.lora_modules)}" if settings.lora_modules else "")
            + (
                f" kv_events={args.kv_events_endpoint} ({settings.kv_events.fmt})"
                if settings.kv_events is not None
                else ""
            )
            + (
                f" kv_role={settings.kv_transfer.role} side_channel={server.side.host}:{server.side.port}"
                if settings.kv_transfer is not None and server.side is not None
                else (f" kv_role={settings.kv_transfer.role}" if settings.kv_transfer is not None else "")
            ),
            file=sys.stderr,
            flush=True,
        )
        try:
            await signals.stop.wait()
        finally:
            await server.stop()


def run(args: argparse.Namespace) -> int:
    try:
        import uvloop

        uvloop.run(_serve(args))
    except ImportError:
        asyncio.run(_serve(args))
    return 0
