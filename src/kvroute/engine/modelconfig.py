"""A model's architecture (:class:`ModelShape`) read from its Hugging Face ``config.json``.

No list of known models: every number comes from the config's keys, under the spellings the common
families use (first match wins):

========================  =====================================================================
layers                    ``num_hidden_layers``, ``n_layer``, ``num_layers``
hidden size               ``hidden_size``, ``n_embd``, ``d_model``
attention heads           ``num_attention_heads``, ``n_head``, ``num_heads``
KV heads                  ``num_key_value_heads``, ``num_kv_heads``, ``n_head_kv``; absent → MHA
                          (= attention heads)
head dim                  ``head_dim``; absent → hidden / heads
vocabulary                ``vocab_size``
dense MLP width           ``intermediate_size``, ``ffn_dim``, ``n_inner``; required for a dense model
routed experts            ``num_experts``, ``num_local_experts``, ``n_routed_experts``,
                          ``moe_num_experts``; absent or 0 → dense
experts per token         ``num_experts_per_tok``, ``num_experts_per_token``, ``moe_topk``,
                          ``top_k``; required for a MoE model
expert MLP width          ``moe_intermediate_size``; absent → ``intermediate_size`` (Mixtral)
shared experts            ``shared_expert_intermediate_size`` (Qwen2-MoE), or
                          ``n_shared_experts`` × expert width (DeepSeek)
leading dense layers      ``first_k_dense_replace`` (DeepSeek: their MLP is ``intermediate_size``)
MLA latent KV             ``kv_lora_rank`` + ``qk_rope_head_dim`` (DeepSeek V2/V3: one latent per
                          token and layer instead of K and V per head)
dtype                     ``torch_dtype``, ``dtype``; absent → bfloat16 (vLLM's ``auto`` for a
                          config without one); sets the weight and KV element size
tied embeddings           ``tie_word_embeddings``; absent → true (``PretrainedConfig``'s default)
========================  =====================================================================

Multimodal configs keep the language model under ``text_config`` (Llama 4, Gemma 3, Mistral 3),
``llm_config`` (InternVL) or ``language_config``; its keys win over the top level, which still supplies
``torch_dtype`` and ``tie_word_embeddings`` when the nested part lacks them.

Errors are one line naming the file and the key (:class:`~kvroute.errors.UserError`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvroute.errors import UserError

__all__ = [
    "ModelShape",
    "find_model_config",
    "is_hf_config",
    "load_model_config",
    "parse_hf_config",
]


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The architecture numbers a cost model and a KV budget need (from the model's HF ``config.json``).

    ``intermediate`` is the dense MLP width (for a MoE model: of its leading dense layers, if any);
    ``moe_intermediate`` the per-expert FFN width (0 for a dense model); ``shared_intermediate`` the
    always-active shared experts' total width per MoE layer; ``dense_layers`` how many leading layers
    of a MoE model have a dense MLP; ``kv_latent_dim`` the per-layer latent an MLA model caches instead
    of K and V (0: K and V per KV head); ``dtype_bytes`` the weight and KV element size (2 for bf16).
    """

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0
    tied_embeddings: bool = False
    dtype_bytes: int = 2
    shared_intermediate: int = 0
    dense_layers: int = 0
    kv_latent_dim: int = 0

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes per token over all layers: 2 (K and V) × layers × kv_heads × head_dim × dtype,
        or layers × latent × dtype for MLA."""
        if self.kv_latent_dim:
            return self.num_layers * self.kv_latent_dim * self.dtype_bytes
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def kv_bytes_per_token_per_rank(self, tp: int = 1) -> float:
        """KV bytes per token held by one of ``tp`` tensor-parallel ranks: KV heads are split over the
        ranks (replicated when there are fewer heads than ranks); an MLA latent is replicated."""
        if self.kv_latent_dim or tp <= 1:
            return float(self.kv_bytes_per_token)
        if self.num_kv_heads >= tp:
            return self.kv_bytes_per_token / tp
        return self.kv_bytes_per_token / self.num_kv_heads  # one (replicated) KV head per rank

    def param_counts(self) -> tuple[int, int]:
        """(parameters outside the routed experts, parameters in the routed experts); norms included."""
        attn = self.hidden * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        attn += self.num_heads * self.head_dim * self.hidden
        norms = 2 * self.hidden + 2 * self.head_dim  # two RMSNorms + q/k norms (Qwen3; ~0 for others)
        if self.num_experts:
            moe_layers = self.num_layers - self.dense_layers
            router = self.hidden * self.num_experts
            experts = moe_layers * self.num_experts * 3 * self.hidden * self.moe_intermediate
            shared = 3 * self.hidden * self.shared_intermediate
            dense_mlp = self.dense_layers * 3 * self.hidden * self.intermediate
            body = self.num_layers * (attn + norms) + moe_layers * (router + shared) + dense_mlp
        else:
            experts = 0
            body = self.num_layers * (attn + norms + 3 * self.hidden * self.intermediate)
        embed = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return body + embed + self.hidden, experts

    def weight_bytes(self, ep: int = 1, tp: int = 1) -> int:
        """Weight bytes held by one GPU: non-expert weights split over ``tp``, experts over ``ep × tp``."""
        dense, experts = self.param_counts()
        return (dense // tp + experts // (ep * tp)) * self.dtype_bytes


_NESTED = ("text_config", "llm_config", "language_config")
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers")
_HIDDEN = ("hidden_size", "n_embd", "d_model")
_HEADS = ("num_attention_heads", "n_head", "num_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_head_kv")
_FFN = ("intermediate_size", "ffn_dim", "n_inner")
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOPK = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k")
_DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
}


def is_hf_config(data: Any) -> bool:
    """True when ``data`` looks like a Hugging Face model config (has a layer count, maybe nested)."""
    if not isinstance(data, Mapping):
        return False
    if any(k in data for k in _LAYERS):
        return True
    return any(isinstance(data.get(n), Mapping) and any(k in data[n] for k in _LAYERS) for n in _NESTED)


def _text_part(data: Mapping[str, Any]) -> dict[str, Any]:
    for key in _NESTED:
        nested = data.get(key)
        if isinstance(nested, Mapping) and any(k in nested for k in _LAYERS):
            merged = dict(nested)
            for inherited in ("torch_dtype", "dtype", "tie_word_embeddings"):
                if inherited not in merged and inherited in data:
                    merged[inherited] = data[inherited]
            return merged
    return dict(data)


def parse_hf_config(data: Any, where: str, name: str | None = None) -> ModelShape:
    """The :class:`ModelShape` of a parsed ``config.json`` (module docstring for the keys).

    ``where`` names the file in errors; ``name`` is the model's name (default: the config's
    ``_name_or_path``, else ``where``).
    """
    if not isinstance(data, Mapping):
        raise UserError(f"{where}: not a JSON object")
    cfg = _text_part(data)

    def pick(keys: tuple[str, ...]) -> tuple[str, Any] | None:
        for k in keys:
            if cfg.get(k) is not None:
                return k, cfg[k]
        return None

    def integer(key: str, value: Any, *, minimum: int = 1) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            bound = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise UserError(f"{where}: key {key!r} must be {bound}, got {value!r}")
        return value

    def required(keys: tuple[str, ...], why: str = "") -> int:
        found = pick(keys)
        if found is None:
            raise UserError(f"{where}: missing key {keys[0]!r}{why} (a Hugging Face model config.json?)")
        return integer(*found)

    def optional(keys: tuple[str, ...], default: int, minimum: int = 1) -> int:
        found = pick(keys)
        return default if found is None else integer(*found, minimum=minimum)

    layers = required(_LAYERS)
    hidden = required(_HIDDEN)
    heads = required(_HEADS)
    kv_heads = optional(_KV_HEADS, heads)
    head_dim = optional(("head_dim",), 0)
    if not head_dim:
        if hidden % heads:
            raise UserError(
                f"{where}: no 'head_dim' and hidden_size {hidden} is not a multiple of {heads} heads"
            )
        head_dim = hidden // heads
    vocab = required(("vocab_size",))
    experts = optional(_EXPERTS, 0, minimum=0)
    ffn = pick(_FFN)
    intermediate = integer(*ffn) if ffn is not None else 0
    topk = moe_ffn = shared = dense_layers = 0
    if experts:
        topk = required(_TOPK, f" (a MoE model: {experts} experts)")
        moe_ffn = optional(("moe_intermediate_size",), intermediate)
        if not moe_ffn:
            raise UserError(f"{where}: missing key 'moe_intermediate_size' (a MoE model: {experts} experts)")
        shared = optional(("shared_expert_intermediate_size",), 0, minimum=0)
        if not shared:
            shared = optional(("n_shared_experts",), 0, minimum=0) * moe_ffn
        dense_layers = min(optional(("first_k_dense_replace",), 0, minimum=0), layers)
    elif not intermediate:
        raise UserError(f"{where}: missing key 'intermediate_size' (a dense model)")
    latent = 0
    if cfg.get("kv_lora_rank") is not None:
        latent = integer("kv_lora_rank", cfg["kv_lora_rank"]) + optional(("qk_rope_head_dim",), 0, minimum=0)
    dtype_key = next((k for k in ("torch_dtype", "dtype") if cfg.get(k) is not None), None)
    dtype_bytes = 2
    if dtype_key is not None:
        dtype = str(cfg[dtype_key]).removeprefix("torch.")
        if dtype not in _DTYPE_BYTES:
            raise UserError(f"{where}: key {dtype_key!r}: unknown dtype {cfg[dtype_key]!r}")
        dtype_bytes = _DTYPE_BYTES[dtype]
    tied = cfg.get("tie_word_embeddings", True)
    if not isinstance(tied, bool):
        raise UserError(f"{where}: key 'tie_word_embeddings' must be true or false, got {tied!r}")
    return ModelShape(
        name=name or str(data.get("_name_or_path") or where),
        num_layers=layers,
        hidden=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=vocab,
        intermediate=intermediate,
        num_experts=experts,
        experts_per_token=topk,
        moe_intermediate=moe_ffn,
        tied_embeddings=tied,
        dtype_bytes=dtype_bytes,
        shared_intermediate=shared,
        dense_layers=dense_layers,
        kv_latent_dim=latent,
    )


def read_config_json(path: Path) -> Any:
    """The parsed JSON of ``path``; UserError (one line, naming the file) when missing or not JSON."""
    if not path.is_file():
        raise UserError(
            f"model config missing: {path} (give the model's Hugging Face config.json with --model-config FILE)"
        )
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: not JSON ({exc})") from None


def load_model_config(path: str | Path, name: str | None = None) -> ModelShape:
    """The :class:`ModelShape` of the Hugging Face ``config.json`` at ``path`` (see :func:`parse_hf_config`)."""
    p = Path(path)
    data = read_config_json(p)
    if not is_hf_config(data):
        raise UserError(
            f"{p}: not a Hugging Face model config (no num_hidden_layers); "
            "give the model's config.json with --model-config FILE"
        )
    return parse_hf_config(data, str(p), name)


def find_model_config(profile_dir: str | Path) -> Path | None:
    """A Hugging Face ``config.json`` next to a profile: in ``profile_dir`` or its parent (the model's
    folder above ``<variant>/``); files that are not model configs (e.g. a simulator's cluster config)
    are passed over. None when there is none."""
    root = Path(profile_dir)
    for cand in (root / "config.json", root.parent / "config.json"):
        if cand.is_file():
            try:
                data = json.loads(cand.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise UserError(f"{cand}: not JSON") from None
            if is_hf_config(data):
                return cand
    return None
