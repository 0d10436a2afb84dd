"""Model specs for the planner: dimensions, parameter counts, FLOPs and activation sizes.

A :class:`ModelSpec` comes from a preset name, a Hugging Face ``config.json`` (Llama, Mistral,
Qwen2/2-MoE/3/3-MoE, Gemma 1/2/3, GPT-2, Mixtral, Llama 4) or explicit dimensions
(``hidden=4096,layers=32,...``). Parameter counts follow the module layout of the reference
implementations, so they match the published totals (see ``PUBLISHED_TOTALS``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fp4offload.errors import ConfigError

__all__ = ["ModelSpec", "PRESETS", "PUBLISHED_TOTALS", "PUBLISHED_ACTIVE", "from_hf_config", "parse_dims",
           "resolve_model", "MAX_LAYERS", "MAX_WIDTH", "MAX_EXPERTS", "MAX_PARAMS"]

# Bounds past any real model, so that a typo (or a hostile file) is refused at once instead of planned for:
# the deepest published transformers have about a thousand blocks (DeepNet; released LLMs at most ~130), the
# widest about 5e4 (hidden, ffn) and 2.6e5 (vocabulary), the most experts a few hundred, and the largest models
# about 2e12 parameters.
#: decoder blocks
MAX_LAYERS = 10_000
#: hidden, ffn, expert_ffn, vocab, head_dim, positions, heads (each)
MAX_WIDTH = 1 << 24
#: experts per MoE block
MAX_EXPERTS = 1 << 16
#: total parameters (500x the largest model trained)
MAX_PARAMS = 10 ** 15

_INT_FIELDS = ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "head_dim", "norms_per_layer", "positions",
               "experts", "experts_per_token", "expert_ffn", "shared_expert_ffn", "extra_params")
_BOOL_FIELDS = ("tied", "gated", "qkv_bias", "out_bias", "mlp_bias", "qk_norm", "shared_expert_gate")
#: what the largest released models have, per field: the field most over it is named when the total is too large
_LARGEST = {"hidden": 16384, "layers": 126, "ffn": 53248, "vocab": 262144, "experts": 256, "expert_ffn": 8192,
            "head_dim": 256, "shared_expert_ffn": 8192, "positions": 131072, "extra_params": 10 ** 10}


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, described by the dimensions that set its memory and compute.

    Attributes:
        name: label shown in plans.
        hidden: model width. layers: decoder blocks. heads / kv_heads: query and key-value heads.
        ffn: intermediate size of dense MLP blocks. vocab: vocabulary size.
        head_dim: per-head width; None means hidden // heads.
        tied: the output head shares the embedding matrix.
        gated: gated MLP with three matrices (SwiGLU/GeGLU); False for GPT-2's two-matrix MLP.
        norm: "rms" (weight only) or "layer" (weight and bias). norms_per_layer: 2, or 4 (Gemma 2/3).
        qkv_bias / out_bias / mlp_bias: bias vectors on q,k,v / the output projection / the MLP.
        qk_norm: per-head RMSNorm weights on q and k (Qwen3, Gemma 3).
        positions: learned absolute position embeddings (GPT-2); 0 with rotary embeddings.
        experts: experts per MoE block (0 = dense model). experts_per_token: routed experts a token uses.
        expert_ffn: intermediate size of one expert. shared_expert_ffn: an always-on expert (0 = none).
        shared_expert_gate: a sigmoid gate vector on the shared expert (Qwen2-MoE).
        moe_layers: indices of MoE blocks; None means every block when experts > 0.
        extra_params: parameters outside the decoder stack that are trained but cost no FLOPs per
            text token here (a vision tower).
        family: the Hugging Face ``model_type`` ("llama", "qwen3_moe", ...), "" when unknown.
    """

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    head_dim: int | None = None
    tied: bool = False
    gated: bool = True
    norm: str = "rms"
    norms_per_layer: int = 2
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    positions: int = 0
    experts: int = 0
    experts_per_token: int = 0
    expert_ffn: int = 0
    shared_expert_ffn: int = 0
    shared_expert_gate: bool = False
    moe_layers: tuple[int, ...] | None = None
    extra_params: int = 0
    family: str = ""

    def __post_init__(self) -> None:
        for k in _INT_FIELDS:
            v = getattr(self, k)
            if v is None and k == "head_dim":
                continue
            low = 1 if k in ("hidden", "layers", "heads", "kv_heads", "vocab", "head_dim") else 0
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigError(f"model.{k}", v, "a positive integer" if low else "a non-negative integer")
            high = {"layers": MAX_LAYERS, "experts": MAX_EXPERTS, "extra_params": MAX_PARAMS,
                    "norms_per_layer": 8}.get(k, MAX_WIDTH)
            if v > high:
                raise ConfigError(f"model.{k}", v, f"at most {high:,}", "no real model is that large: check the value")
        for k in _BOOL_FIELDS:
            if not isinstance(getattr(self, k), bool):
                raise ConfigError(f"model.{k}", getattr(self, k), "true or false")
        if self.heads % self.kv_heads:
            raise ConfigError("model.kv_heads", self.kv_heads, f"a divisor of heads ({self.heads})")
        if self.head_dim is None and self.hidden % self.heads:
            raise ConfigError("model.head_dim", None, "set explicitly when hidden is not a multiple of heads")
        if self.norm not in ("rms", "layer"):
            raise ConfigError("model.norm", self.norm, "'rms' or 'layer'")
        if self.experts:
            if not 1 <= self.experts_per_token <= self.experts:
                raise ConfigError("model.experts_per_token", self.experts_per_token, f"1..{self.experts}")
            if self.expert_ffn < 1:
                raise ConfigError("model.expert_ffn", self.expert_ffn, "a positive integer for an MoE model")
        elif self.ffn < 1:
            raise ConfigError("model.ffn", self.ffn, "a positive integer")
        if self.moe_layers is not None:
            if not isinstance(self.moe_layers, tuple) or not all(
                    isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.layers for i in self.moe_layers):
                raise ConfigError("model.moe_layers", self.moe_layers, f"block indices in 0..{self.layers - 1}")
        n = self.param_count()
        if n > MAX_PARAMS:
            worst = max(_LARGEST, key=lambda k: (getattr(self, k) or 0) / _LARGEST[k])
            raise ConfigError(f"model.{worst}", getattr(self, worst), f"a model of at most {MAX_PARAMS:.0e} "
                              f"parameters (this one has {n:.3g})", "no real model is that large: check the value")

    # -- shapes -----------------------------------------------------------------------------

    @property
    def hd(self) -> int:
        """Per-head width."""
        return self.head_dim or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        return self.heads * self.hd

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.hd

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @functools.cached_property
    def _moe_set(self) -> frozenset[int]:
        return frozenset(range(self.layers) if self.moe_layers is None else self.moe_layers) if self.experts \
            else frozenset()

    def is_moe_layer(self, i: int) -> bool:
        return i in self._moe_set

    @property
    def moe_layer_count(self) -> int:
        """Blocks with an MoE FFN (the others have the dense one)."""
        return len(self._moe_set)

    @functools.cached_property
    def layer_runs(self) -> tuple[tuple[int, int, bool], ...]:
        """The blocks as runs of one kind: (first block, blocks, MoE?), in order. One run for a dense model or
        an MoE model with MoE in every block; what the per-block sums of the planner iterate over."""
        runs: list[list] = []
        moe = self._moe_set
        if not moe or len(moe) == self.layers:
            return ((0, self.layers, bool(moe)),)
        for i in range(self.layers):
            kind = i in moe
            if runs and runs[-1][2] == kind:
                runs[-1][1] += 1
            else:
                runs.append([i, 1, kind])
        return tuple((a, n, k) for a, n, k in runs)

    def _per_kind(self, fn) -> int:
        """sum(fn(moe) for every block), in closed form: fn of each kind times its block count."""
        n_moe = self.moe_layer_count
        return (self.layers - n_moe) * fn(False) + (n_moe * fn(True) if n_moe else 0)

    # -- parameter counts -------------------------------------------------------------------

    def _mlp(self, ffn: int) -> int:
        mats = 3 if self.gated else 2
        bias = ((2 if self.gated else 1) * ffn + self.hidden) if self.mlp_bias else 0
        return mats * self.hidden * ffn + bias

    def _norm(self) -> int:
        return self.hidden * (2 if self.norm == "layer" else 1)

    def attention_params(self) -> int:
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        n = h * q + 2 * h * kv + q * h
        n += (q + 2 * kv) if self.qkv_bias else 0
        n += h if self.out_bias else 0
        n += 2 * self.hd if self.qk_norm else 0
        return n

    def _ffn_kind(self, moe: bool, active: bool) -> int:
        if not moe:
            return self._mlp(self.ffn)
        k = self.experts_per_token if active else self.experts
        n = k * self._mlp(self.expert_ffn) + self.hidden * self.experts  # experts + router
        if self.shared_expert_ffn:
            n += self._mlp(self.shared_expert_ffn) + (self.hidden if self.shared_expert_gate else 0)
        return n

    def kind_params(self, moe: bool, active: bool = False) -> int:
        """Parameters of one block of the kind ``moe`` (only the routed experts a token uses when ``active``)."""
        return self.attention_params() + self.norms_per_layer * self._norm() + self._ffn_kind(moe, active)

    def layer_params(self, i: int, active: bool = False) -> int:
        """Parameters of decoder block ``i`` (only the routed experts a token uses when ``active``)."""
        return self.kind_params(self.is_moe_layer(i), active)

    def blocks_params(self, active: bool = False) -> int:
        """All decoder blocks' parameters (closed form: per kind of block, times its count)."""
        return self._per_kind(lambda moe: self.kind_params(moe, active))

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden + self.positions * self.hidden

    @property
    def head_params(self) -> int:
        return 0 if self.tied else self.vocab * self.hidden

    def param_count(self) -> int:
        """Total parameters, as a checkpoint holds them."""
        return self.embed_params + self.blocks_params() + self._norm() + self.head_params + self.extra_params

    def active_param_count(self) -> int:
        """Parameters a text token passes through: routed experts counted experts_per_token times,
        the vision tower (``extra_params``) left out."""
        return self.embed_params + self.blocks_params(True) + self._norm() + self.head_params

    def units(self) -> list[int]:
        """Parameter counts of the pieces ZeRO-3/FSDP gather one at a time: embedding, blocks, head."""
        out = [self.embed_params] + [self.layer_params(i) for i in range(self.layers)]
        if self.head_params:
            out.append(self.head_params + self._norm())
        return out

    def largest_units(self, k: int = 2) -> list[int]:
        """The ``k`` largest of :meth:`units`, largest first (without listing every block)."""
        n_moe = self.moe_layer_count
        pool = [self.embed_params] + [self.kind_params(False)] * min(self.layers - n_moe, k)
        pool += [self.kind_params(True)] * min(n_moe, k)
        if self.head_params:
            pool.append(self.head_params + self._norm())
        return sorted(pool, reverse=True)[:k]

    # -- compute ----------------------------------------------------------------------------

    def matmul_params_per_token(self) -> int:
        """Weights that enter a matrix product per token (embedding lookups excluded, head included)."""
        return self.blocks_params(True) + self.vocab * self.hidden

    def train_flops_per_token(self, seq_len: int, recompute: bool = False) -> float:
        """Forward + backward FLOPs per token: 6 x matmul weights + 6 x layers x seq x q_dim
        (causal attention); a full recomputation of the blocks adds one forward of them."""
        blocks = self.blocks_params(True)
        attn = 6.0 * self.layers * seq_len * self.q_dim
        flops = 6.0 * self.matmul_params_per_token() + attn
        if recompute:
            flops += 2.0 * blocks + attn / 3.0
        return flops

    # -- activations ------------------------------------------------------------------------

    def _norm_saved(self, e: int) -> int:
        # Eager RMSNorm (HF) saves the fp32 input, the normed value in the compute dtype and its
        # output; a fused LayerNorm saves its input and its output.
        return 4 * self.hidden + 2 * e * self.hidden if self.norm == "rms" else 2 * e * self.hidden

    def _mlp_saved(self, ffn: int, e: int) -> int:
        return (4 if self.gated else 2) * e * ffn

    def kind_saved_bytes_per_token(self, moe: bool, e: int = 2) -> int:
        """Bytes autograd keeps per token for one block of the kind ``moe`` without checkpointing (``e`` = bytes
        per element of the compute dtype): norms, q/k/v after rotary, attention output and the output
        projection's input, the attention log-sum-exp, and the MLP's inner tensors."""
        n = self.norms_per_layer * self._norm_saved(e)
        n += e * (self.q_dim + 2 * self.kv_dim) + 2 * e * self.q_dim + 4 * self.heads
        if moe:
            k = self.experts_per_token
            n += k * self._mlp_saved(self.expert_ffn, e) + 2 * e * self.hidden * k + 4 * self.experts
            if self.shared_expert_ffn:
                n += self._mlp_saved(self.shared_expert_ffn, e)
        else:
            n += self._mlp_saved(self.ffn, e)
        return n

    def kind_saved_classes(self, moe: bool, e: int = 2) -> dict[str, tuple[int, int]]:
        """:meth:`kind_saved_bytes_per_token` split by the class the activation hooks store each tensor in
        (fp4offload/_offload/ops.py): class -> (elements, bytes in the compute dtype) per token. ``norm``: what a
        norm layer saves besides its output; ``attention_qk``: q and k after rotary; ``attention``: v and the
        attention output; ``statistic``: the log-sum-exp (fp32, kept exactly); ``mlp``: what the activation
        function and the gate product save (gated: the gate, its activation and up; otherwise the activation's
        input); ``rest``: linear-layer inputs (the norms' outputs, the output projection's and the down
        projection's inputs) and the router's."""
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        norm = (2 * h, 4 * h + e * h) if self.norm == "rms" else (h, e * h)
        total = self.kind_saved_bytes_per_token(moe, e)
        inner = 3 if self.gated else 1  # of the _mlp_saved tensors per ffn unit, all but the down projection's input
        mlp = (self.experts_per_token * self.expert_ffn + (self.shared_expert_ffn or 0)) if moe else self.ffn
        parts = {"norm": (self.norms_per_layer * norm[0], self.norms_per_layer * norm[1]),
                 "attention_qk": (q + kv, e * (q + kv)), "attention": (kv + q, e * (kv + q)),
                 "statistic": (self.heads, 4 * self.heads), "mlp": (inner * mlp, e * inner * mlp)}
        rest = total - sum(b for _, b in parts.values())
        parts["rest"] = (rest // e, rest)
        return parts

    def layer_saved_bytes_per_token(self, i: int, e: int = 2) -> int:
        """:meth:`kind_saved_bytes_per_token` of block ``i``."""
        return self.kind_saved_bytes_per_token(self.is_moe_layer(i), e)

    def saved_bytes_per_token(self, e: int = 2) -> int:
        """All blocks plus the final norm, per token, without checkpointing."""
        return self._per_kind(lambda moe: self.kind_saved_bytes_per_token(moe, e)) + self._norm_saved(e)

    def logits_peak_bytes_per_token(self, e: int = 2) -> int:
        """Peak bytes of the loss region per token: logits in the compute dtype (held by the
        caller) plus the fp32 log-softmax output, its incoming and its outgoing gradient."""
        return (e + 12) * self.vocab

    @property
    def block_class(self) -> str | None:
        """Class name of the decoder block in Hugging Face transformers (what FSDP2 wraps)."""
        return BLOCK_CLASSES.get(self.family)

    def describe(self) -> str:
        kind = f"MoE {self.experts}x, top-{self.experts_per_token}" if self.is_moe else "dense"
        return (f"{self.name}: {self.param_count() / 1e9:.2f}B params ({kind}), {self.layers} layers, "
                f"hidden {self.hidden}, heads {self.heads}/{self.kv_heads}, vocab {self.vocab}")


BLOCK_CLASSES = {
    "llama": "LlamaDecoderLayer", "mistral": "MistralDecoderLayer", "qwen2": "Qwen2DecoderLayer",
    "qwen2_moe": "Qwen2MoeDecoderLayer", "qwen3": "Qwen3DecoderLayer", "qwen3_moe": "Qwen3MoeDecoderLayer",
    "gemma": "GemmaDecoderLayer", "gemma2": "Gemma2DecoderLayer", "gemma3_text": "Gemma3DecoderLayer",
    "gpt2": "GPT2Block", "mixtral": "MixtralDecoderLayer", "llama4_text": "Llama4TextDecoderLayer",
}

# ---------------------------------------------------------------------------------------------
# Presets (dimensions from the models' published config.json files)

def _p(name: str, family: str, *dims: int, **kw) -> ModelSpec:
    return ModelSpec(name, *dims, family=family, **kw)


_LLAMA3 = dict(vocab=128256)
PRESETS: dict[str, ModelSpec] = {m.name: m for m in (
    _p("gpt2", "gpt2", 768, 12, 12, 12, 3072, 50257, tied=True, gated=False, norm="layer", qkv_bias=True,
       out_bias=True, mlp_bias=True, positions=1024),
    _p("gpt2-xl", "gpt2", 1600, 48, 25, 25, 6400, 50257, tied=True, gated=False, norm="layer", qkv_bias=True,
       out_bias=True, mlp_bias=True, positions=1024),
    _p("llama-2-7b", "llama", 4096, 32, 32, 32, 11008, 32000),
    _p("llama-2-13b", "llama", 5120, 40, 40, 40, 13824, 32000),
    _p("llama-3.2-1b", "llama", 2048, 16, 32, 8, 8192, tied=True, head_dim=64, **_LLAMA3),
    _p("llama-3.2-3b", "llama", 3072, 28, 24, 8, 8192, tied=True, head_dim=128, **_LLAMA3),
    _p("llama-3.1-8b", "llama", 4096, 32, 32, 8, 14336, **_LLAMA3),
    _p("llama-3.1-70b", "llama", 8192, 80, 64, 8, 28672, **_LLAMA3),
    _p("llama-3.1-405b", "llama", 16384, 126, 128, 8, 53248, **_LLAMA3),
    _p("mistral-7b", "mistral", 4096, 32, 32, 8, 14336, 32768),
    _p("qwen2.5-7b", "qwen2", 3584, 28, 28, 4, 18944, 152064, qkv_bias=True),
    _p("qwen3-8b", "qwen3", 4096, 36, 32, 8, 12288, 151936, head_dim=128, qk_norm=True),
    _p("qwen3-32b", "qwen3", 5120, 64, 64, 8, 25600, 151936, head_dim=128, qk_norm=True),
    _p("qwen3-30b-a3b", "qwen3_moe", 2048, 48, 32, 4, 6144, 151936, head_dim=128, qk_norm=True, experts=128,
       experts_per_token=8, expert_ffn=768),
    _p("gemma-2-9b", "gemma2", 3584, 42, 16, 8, 14336, 256000, head_dim=256, tied=True, norms_per_layer=4),
    _p("mixtral-8x7b", "mixtral", 4096, 32, 32, 8, 14336, 32000, experts=8, experts_per_token=2, expert_ffn=14336),
    _p("llama-4-scout-17b-16e", "llama4_text", 5120, 48, 40, 8, 16384, 202048, head_dim=128, experts=16,
       experts_per_token=1, expert_ffn=8192, shared_expert_ffn=8192),  # + the vision tower, below
)}

# Published totals (model cards / release notes), used by the tests: the counts above must
# land within 1% of these.
PUBLISHED_TOTALS: dict[str, float] = {
    "gpt2": 124.44e6, "gpt2-xl": 1.558e9, "llama-2-7b": 6.738e9, "llama-2-13b": 13.016e9,
    "llama-3.2-1b": 1.24e9, "llama-3.2-3b": 3.21e9,
    "llama-3.1-8b": 8.03e9, "llama-3.1-70b": 70.6e9, "llama-3.1-405b": 405.9e9, "mistral-7b": 7.25e9,
    "qwen2.5-7b": 7.61e9, "qwen3-8b": 8.2e9, "qwen3-32b": 32.8e9, "qwen3-30b-a3b": 30.5e9,
    "gemma-2-9b": 9.24e9, "mixtral-8x7b": 46.7e9, "llama-4-scout-17b-16e": 109e9,
}
PUBLISHED_ACTIVE: dict[str, float] = {"mixtral-8x7b": 12.9e9, "qwen3-30b-a3b": 3.3e9, "llama-4-scout-17b-16e": 17e9}


# ---------------------------------------------------------------------------------------------
# Hugging Face config.json: fp4offload._planner.hf_config (it needs ModelSpec, defined above)

from fp4offload._planner.hf_config import _llama4_vision_params, from_hf_config  # noqa: E402


PRESETS["llama-4-scout-17b-16e"] = replace(
    PRESETS["llama-4-scout-17b-16e"],
    extra_params=_llama4_vision_params(
        {"hidden_size": 1408, "intermediate_size": 5632, "num_hidden_layers": 34, "patch_size": 14,
         "image_size": 336, "num_channels": 3, "pixel_shuffle_ratio": 0.5, "projector_input_dim": 4096,
         "projector_output_dim": 4096, "vision_output_dim": 4096}, 5120))


# ---------------------------------------------------------------------------------------------
# Explicit dimensions

_DIM_KEYS = {
    "hidden": int, "layers": int, "heads": int, "kv_heads": int, "ffn": int, "vocab": int, "head_dim": int,
    "tied": bool, "gated": bool, "experts": int, "top_k": int, "expert_ffn": int, "shared_expert_ffn": int,
    "positions": int, "qkv_bias": bool, "name": str,
}


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_dims(text: str) -> ModelSpec:
    """``hidden=4096,layers=32,heads=32,kv_heads=8,ffn=14336,vocab=128256[,tied=1,experts=8,top_k=2,...]``.

    Each key once; integers at most :data:`MAX_LAYERS` (``layers``) or :data:`MAX_WIDTH` (widths), booleans one of
    1/0, true/false, yes/no, on/off: errors name the key (``--model layers``); values too small or that do not fit
    together are ModelSpec's errors (``model.layers``)."""
    vals: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise ConfigError("--model", part, "key=value pairs separated by commas")
        k, v = (s.strip() for s in part.split("=", 1))
        if k not in _DIM_KEYS:
            raise ConfigError(f"--model {k}", v, "one of " + ", ".join(_DIM_KEYS))
        if k in vals:
            raise ConfigError(f"--model {k}", v, "each key once", f"{k} is also given as {vals[k]!r}")
        typ = _DIM_KEYS[k]
        if typ is bool:
            if v.lower() not in _TRUE + _FALSE:
                raise ConfigError(f"--model {k}", v, "true or false (1/0, yes/no, on/off)")
            vals[k] = v.lower() in _TRUE
        elif typ is int:
            try:
                vals[k] = int(v)
            except ValueError:
                raise ConfigError(f"--model {k}", v, "an integer") from None
            high = {"layers": MAX_LAYERS, "experts": MAX_EXPERTS, "top_k": MAX_EXPERTS}.get(k, MAX_WIDTH)
            if vals[k] > high:  # too small: ModelSpec says so (model.<key>)
                raise ConfigError(f"--model {k}", vals[k], f"at most {high:,}",
                                  "no real model is that large: check the value")
        else:
            vals[k] = v
    for k in ("hidden", "layers", "heads", "vocab"):
        if k not in vals:
            raise ConfigError(f"--model {k}", None, "given", "explicit dims need hidden, layers, heads, vocab and ffn")
    if "ffn" not in vals and not vals.get("experts"):
        raise ConfigError("--model ffn", None, "given", "explicit dims need hidden, layers, heads, vocab and ffn")
    kw = dict(name=vals.pop("name", "custom"), hidden=vals.pop("hidden"), layers=vals.pop("layers"),
              heads=vals.pop("heads"), kv_heads=vals.pop("kv_heads", None), ffn=vals.pop("ffn", 0),
              vocab=vals.pop("vocab"))
    kw["kv_heads"] = kw["kv_heads"] or kw["heads"]
    if "top_k" in vals:
        vals["experts_per_token"] = vals.pop("top_k")
    if vals.get("experts"):
        vals.setdefault("experts_per_token", 1)
        vals.setdefault("expert_ffn", kw["ffn"])
    return ModelSpec(**kw, **vals)


def resolve_model(text: str) -> ModelSpec:
    """A preset name, a path to config.json (or its directory), or explicit dims."""
    key = text.strip().lower()
    if key in PRESETS:
        return PRESETS[key]
    p = Path(text).expanduser()
    if p.exists():
        return from_hf_config(p)
    if "=" in text:
        return parse_dims(text)
    raise ConfigError("--model", text, "a preset (" + ", ".join(sorted(PRESETS)) + "), a path to a Hugging Face "
                      "config.json, or dims like hidden=4096,layers=32,heads=32,kv_heads=8,ffn=14336,vocab=128256",
                      "no such preset and no such file")
