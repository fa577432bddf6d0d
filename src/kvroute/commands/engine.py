"""`kvroute engine`: an emulated vLLM-compatible engine server (OpenAI API, /metrics, ZMQ KV events)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from dataclasses import replace
from typing import TYPE_CHECKING

from kvroute.commands import port_number
from kvroute.errors import UserError

if TYPE_CHECKING:
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
        "(default: array, or sglang with --flavor sglang)",
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
    p.add_argument("--kv-events-topic", default="", help="ZMQ topic (default empty)")
    p.add_argument("--kv-events-replay-endpoint", default=None, help="ZMQ ROUTER endpoint for replay")
    p.add_argument(
        "--kv-events-connect",
        action="store_true",
        help="connect the PUB socket to the endpoint instead of binding it",
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
    fmt: EventFormat = args.kv_events_format or ("sglang" if args.flavor == "sglang" else "array")
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
    if args.kv_events_endpoint:
        kv = KVEventsSettings(
            args.kv_events_endpoint,
            fmt,
            args.kv_events_topic,
            args.kv_events_replay_endpoint,
            args.kv_events_connect,
            page or 0,
        )
    settings = EmulatorSettings(
        args.model,
        engine,
        args.time_scale,
        args.default_max_tokens,
        kv,
        lora_modules=adapters,
        flavor=args.flavor,
    )
    return settings, profile, load_tokenizer(args.tokenizer, chat_template=args.chat_template)


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

    settings, profile, tok = build(args)
    server = EmulatorServer(settings, profile.cost, tok)
    try:
        port = await server.start(args.host, args.port)
    except OSError as exc:
        await server.stop()
        raise UserError(f"cannot listen on {args.host}:{args.port}: {exc}") from None
    except zmq.ZMQError as exc:
        await server.stop()
        raise UserError(f"cannot open KV events endpoint {args.kv_events_endpoint}: {exc}") from None
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
        ),
        file=sys.stderr,
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await server.stop()


def run(args: argparse.Namespace) -> int:
    try:
        import uvloop

        uvloop.run(_serve(args))
    except ImportError:
        asyncio.run(_serve(args))
    return 0
