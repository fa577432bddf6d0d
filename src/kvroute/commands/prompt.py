"""`kvroute prompt`: a request body → the rendered prompt, its token ids and block hashes.

What the router computes for a request, shown: the tool to reach for when KV hits look wrong (a
chat template other than the engine's, a tokenizer mismatch). Reads a chat (``messages``, with
``tools``, ``documents``, ``add_generation_prompt``, ``chat_template_kwargs``) or completion
(``prompt``) body from a file or stdin; ``cache_salt`` enters the block hashes as on the router.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvroute.errors import UserError

HELP = "print the prompt, token count and block hashes the router computes for a request body"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("body", nargs="?", default="-", metavar="FILE", help="request body JSON (default: stdin)")
    p.add_argument("--tokenizer", help="tokenizer.json or folder (default: bundled Qwen3)")
    p.add_argument(
        "--chat-template",
        metavar="FILE",
        help="Jinja chat template (default: the tokenizer folder's own, else ChatML)",
    )
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (default 16)")
    p.add_argument("--json", action="store_true", help='print {"prompt", "token_ids", "block_hashes"}')


def _read(name: str) -> tuple[str, Any]:
    where = "<stdin>" if name == "-" else name
    try:
        text = sys.stdin.read() if name == "-" else open(name, encoding="utf-8").read()  # noqa: SIM115
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {where}: {exc}") from None
    try:
        return where, json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{where}:{exc.lineno}: invalid JSON: {exc.msg}") from None


def render(body: Any, where: str, tok: Any) -> tuple[str | None, list[int]]:
    """``(prompt text or None for token ids, token ids)`` of a body; UserError naming ``where``."""
    from kvroute.chat_template import ChatTemplateError, chat_options
    from kvroute.server.wire.validate import ApiError, parse_request

    try:
        req = parse_request(json.dumps(body).encode(), chat=isinstance(body, dict) and "messages" in body)
    except ApiError as exc:
        raise UserError(f"{where}: {exc.message}") from None
    try:
        if req.chat:
            assert req.messages is not None
            text = tok.render_chat(req.messages, options=chat_options(body))
            return text, tok.encode(text)
        if isinstance(req.prompt, str):
            return req.prompt, tok.encode(req.prompt)
        return None, list(req.prompt or [])
    except ChatTemplateError as exc:
        raise UserError(f"{where}: the chat template rejects this conversation: {exc.message}") from None
    except (TypeError, ValueError, KeyError) as exc:
        raise UserError(f"{where}: cannot render the request: {exc}") from None


def run(args: argparse.Namespace) -> int:
    from kvroute.blocks import extra_key, hash_blocks
    from kvroute.tokenizer import load_tokenizer

    if args.block_size < 1:
        raise UserError("--block-size must be >= 1")
    where, body = _read(args.body)
    tok = load_tokenizer(args.tokenizer, chat_template=args.chat_template)
    text, ids = render(body, where, tok)
    salt = body.get("cache_salt") if isinstance(body, dict) else None
    try:
        hashes = hash_blocks(ids, args.block_size, extra_key(None, salt if isinstance(salt, str) else None))
    except ValueError as exc:
        raise UserError(f"{where}: invalid token ids: {exc}") from None
    if args.json:
        print(json.dumps({"prompt": text, "token_ids": ids, "block_hashes": hashes}, ensure_ascii=False))
        return 0
    template = tok.template.origin if tok.template is not None else "ChatML (built in)"
    if text is not None:
        print(text, end="" if text.endswith("\n") else "\n")
    print("---")
    print(f"tokenizer: {tok.name}; chat template: {template}")
    print(f"tokens: {len(ids)}; full blocks of {args.block_size}: {len(hashes)}")
    for i, h in enumerate(hashes):
        print(f"block {i}: {h:016x}")
    return 0
