"""Hugging Face ``config.json`` -> :class:`~fp4offload._planner.models.ModelSpec` for the planner: Llama,
Mistral, Qwen2/2-MoE/3/3-MoE, Gemma 1/2/3, GPT-2, Mixtral and Llama 4 (with its vision tower), each key checked
and named in the error when it is out of range or of the wrong kind."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from fp4offload._jsonfile import read_json
from fp4offload._planner.models import ModelSpec, MAX_LAYERS, MAX_WIDTH, MAX_EXPERTS
from fp4offload.errors import ConfigError

__all__ = ["from_hf_config"]

_TIED_DEFAULT = {"gpt2": True, "gemma": True, "gemma2": True, "gemma3_text": True}
_FOUR_NORMS = ("gemma2", "gemma3_text")
_KNOWN = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "gpt2", "mixtral", "qwen2_moe",
          "qwen3_moe", "llama4_text")


def _cfg_int(cfg: Mapping[str, Any], key: str, *, low: int = 1, high: int = MAX_WIDTH, prefix: str = "",
             default: Any = ..., why: str = "") -> Any:
    """``cfg[key]`` checked to be an integer in [low, high]; when absent (or null) ``default``, or a ConfigError
    naming the key (``prefix`` + key) when there is none."""
    v = cfg.get(key)
    if v is None:
        if default is ...:
            raise ConfigError(prefix + key, None, "present in config.json", why or None)
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ConfigError(prefix + key, v, f"an integer >= {low}")
    if v > high:
        raise ConfigError(prefix + key, v, f"at most {high:,}", "no real model is that large: check the value")
    return v


def _cfg_bool(cfg: Mapping[str, Any], key: str, default: bool, prefix: str = "") -> bool:
    v = cfg.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ConfigError(prefix + key, v, "true or false")
    return v


def _cfg_indices(cfg: Mapping[str, Any], key: str, layers: int, prefix: str = "") -> list[int] | None:
    v = cfg.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers
                                          for i in v):
        raise ConfigError(prefix + key, v, f"a list of block indices in 0..{layers - 1}")
    return v


def _llama4_vision_params(v: Mapping[str, Any], text_hidden: int) -> int:
    """The Llama 4 vision tower: a ViT with biases, a pixel-shuffle MLP adapter and a projector."""
    def need(k: str, default: Any = ...) -> int:
        return _cfg_int(v, k, prefix="vision_config.", default=default, why="a complete Llama 4 vision_config "
                        "needs it", high=MAX_LAYERS if k == "num_hidden_layers" else MAX_WIDTH)

    h, inter, n = need("hidden_size"), need("intermediate_size"), need("num_hidden_layers")
    patch, img, ch = need("patch_size"), need("image_size"), need("num_channels", 3)
    layer = 4 * (h * h + h) + (h * inter + inter) + (inter * h + h) + 2 * 2 * h
    patches = (img // patch) ** 2 + 1
    # The pixel-shuffle adapter maps inter (= hidden / ratio^2 in the released models) to the
    # projector input, then projector output to projector output (the two are equal there).
    out_dim = need("projector_output_dim")
    adapter = inter * need("projector_input_dim") + out_dim * out_dim
    projector = need("vision_output_dim", out_dim) * text_hidden
    return n * layer + h + patches * h + ch * patch * patch * h + 2 * 2 * h + adapter + projector


def _read_config(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(source, Mapping):
        return dict(source)
    p = Path(source)
    if p.is_dir():
        p = p / "config.json"
        if not p.exists():
            raise ConfigError("--model", str(source), "a folder holding a Hugging Face config.json",
                              f"{p} does not exist")
    return read_json(p, "--model", str(source), readable="a readable config.json", valid="a JSON file",
                     top="a JSON object (a Hugging Face config.json)")


#: the config.json key each ModelSpec field comes from (for errors ModelSpec raises on a parsed config)
_HF_KEYS = {"hidden": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
            "kv_heads": "num_key_value_heads", "ffn": "intermediate_size", "vocab": "vocab_size",
            "head_dim": "head_dim", "tied": "tie_word_embeddings", "experts_per_token": "num_experts_per_tok",
            "positions": "max_position_embeddings", "shared_expert_ffn": "shared_expert_intermediate_size"}


def from_hf_config(source: str | Path | Mapping[str, Any], name: str | None = None) -> ModelSpec:
    """Build a spec from a Hugging Face ``config.json`` (path, directory or parsed dict).

    Every value used is checked where it is read: integers must be integers (not floats, strings or booleans)
    in range and below the bounds of :data:`MAX_LAYERS` / :data:`MAX_WIDTH` / :data:`MAX_EXPERTS`, flags must
    be booleans, layer lists must hold block indices; a ConfigError names the config.json key (``text_config.``
    or ``vision_config.`` in front for a multimodal config)."""
    cfg = _read_config(source)
    top_type = cfg.get("model_type", "")
    if top_type is not None and not isinstance(top_type, str):
        raise ConfigError("model_type", top_type, "a string (the Hugging Face model_type)")
    top_type = top_type or ""
    extra = 0
    prefix = ""
    if "text_config" in cfg and isinstance(cfg["text_config"], Mapping):
        text = dict(cfg["text_config"])
        text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
        mt = text.get("model_type") or {"llama4": "llama4_text", "gemma3": "gemma3_text"}.get(top_type, top_type)
        if not isinstance(mt, str):
            raise ConfigError("text_config.model_type", mt, "a string (the Hugging Face model_type)")
        if mt == "llama4_text" and isinstance(cfg.get("vision_config"), Mapping):
            extra = _llama4_vision_params(cfg["vision_config"], _cfg_int(text, "hidden_size", prefix="text_config."))
        cfg, prefix = text, "text_config."
    else:
        mt = top_type
    if mt not in _KNOWN and not {"hidden_size", "num_hidden_layers", "num_attention_heads"} <= cfg.keys():
        raise ConfigError(prefix + "model_type", mt, ", ".join(_KNOWN),
                          "unsupported architecture; give the dimensions instead: --model hidden=...,layers=...")
    why = f"model_type {mt!r} needs it"
    used: dict[str, str] = {}

    def num(field_: str, *keys: str, low: int = 1, default: Any = ..., high: int = MAX_WIDTH) -> Any:
        """The first of ``keys`` present (checked), recorded as where ``field_`` came from."""
        for k in keys:
            if cfg.get(k) is not None:
                used[field_] = k
                return _cfg_int(cfg, k, low=low, high=high, prefix=prefix)
        if default is ...:
            raise ConfigError(prefix + keys[0], None, "present in config.json", why)
        return default

    label = name or cfg.get("_name_or_path") or (Path(source).stem if not isinstance(source, Mapping) else mt)
    if mt == "gpt2":
        h = num("hidden", "n_embd", "hidden_size")
        heads = num("heads", "n_head")
        kw: dict[str, Any] = dict(
            hidden=h, layers=num("layers", "n_layer", "num_hidden_layers", high=MAX_LAYERS), heads=heads,
            kv_heads=heads, ffn=num("ffn", "n_inner", low=0, default=0) or 4 * h, vocab=num("vocab", "vocab_size"),
            tied=_cfg_bool(cfg, "tie_word_embeddings", True, prefix), gated=False, norm="layer", qkv_bias=True,
            out_bias=True, mlp_bias=True, positions=num("positions", "n_positions", "max_position_embeddings"),
            extra_params=extra, family="gpt2")
        return _spec(str(label), kw, used, prefix)

    heads = num("heads", "num_attention_heads")
    n_layers = num("layers", "num_hidden_layers", high=MAX_LAYERS)
    kw = dict(
        hidden=num("hidden", "hidden_size"), layers=n_layers, heads=heads,
        kv_heads=num("kv_heads", "num_key_value_heads", low=0, default=0) or heads,
        ffn=num("ffn", "intermediate_size", low=0, default=0), vocab=num("vocab", "vocab_size"),
        head_dim=num("head_dim", "head_dim", default=None),
        tied=_cfg_bool(cfg, "tie_word_embeddings", _TIED_DEFAULT.get(mt, False), prefix),
        norms_per_layer=4 if mt in _FOUR_NORMS else 2, extra_params=extra, family=mt,
    )
    bias = _cfg_bool(cfg, "attention_bias", False, prefix)
    kw.update(qkv_bias=bias or mt in ("qwen2", "qwen2_moe"), out_bias=bias and mt not in ("qwen2", "qwen2_moe"),
              mlp_bias=_cfg_bool(cfg, "mlp_bias", False, prefix), qk_norm=mt in ("qwen3", "qwen3_moe", "gemma3_text"))
    if mt in ("qwen2_moe", "qwen3_moe"):
        step = num("moe_layers", "decoder_sparse_step", low=0, default=0, high=MAX_LAYERS) or 1
        dense = set(_cfg_indices(cfg, "mlp_only_layers", n_layers, prefix) or [])
        shared = num("shared_expert_ffn", "shared_expert_intermediate_size", low=0, default=0)
        kw.update(experts=num("experts", "num_experts", "num_local_experts", high=MAX_EXPERTS),
                  experts_per_token=num("experts_per_token", "num_experts_per_tok", high=MAX_EXPERTS),
                  expert_ffn=num("expert_ffn", "moe_intermediate_size"), shared_expert_ffn=shared,
                  shared_expert_gate=bool(shared),
                  moe_layers=tuple(i for i in range(n_layers) if i not in dense and (i + 1) % step == 0))
    elif mt == "llama4_text":
        moe = _cfg_indices(cfg, "moe_layers", n_layers, prefix)
        if moe is None:
            step = num("moe_layers", "interleave_moe_layer_step", low=0, default=0, high=MAX_LAYERS) or 1
            moe = list(range(step - 1, n_layers, step))
        else:
            used["moe_layers"] = "moe_layers"
        inter = num("expert_ffn", "intermediate_size")
        kw.update(experts=num("experts", "num_local_experts", high=MAX_EXPERTS),
                  experts_per_token=num("experts_per_token", "num_experts_per_tok", high=MAX_EXPERTS),
                  expert_ffn=inter, shared_expert_ffn=inter,
                  ffn=num("ffn", "intermediate_size_mlp", low=0, default=0) or inter,
                  moe_layers=tuple(sorted(set(moe))), qk_norm=False)
    elif mt == "mixtral" or cfg.get("num_local_experts") is not None:
        kw.update(experts=num("experts", "num_local_experts", high=MAX_EXPERTS),
                  experts_per_token=num("experts_per_token", "num_experts_per_tok", high=MAX_EXPERTS),
                  expert_ffn=num("expert_ffn", "intermediate_size"))
    if kw.get("moe_layers") is not None and len(kw["moe_layers"]) == n_layers:
        kw["moe_layers"] = None
    return _spec(str(label), kw, used, prefix)


def _spec(label: str, kw: dict[str, Any], used: dict[str, str], prefix: str) -> ModelSpec:
    """ModelSpec(label, **kw), its errors naming the config.json key the field came from."""
    try:
        return ModelSpec(label, **kw)
    except ConfigError as e:
        field_ = e.key.removeprefix("model.")
        key = used.get(field_) or _HF_KEYS.get(field_)
        if key is None:
            raise
        hint = str(e).split(f"expected {e.allowed}", 1)[1].lstrip(". ") or None
        raise ConfigError(prefix + key, e.value, e.allowed, hint) from None
