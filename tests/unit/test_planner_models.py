"""Model specs: parameter counts against published totals, Hugging Face config.json parsing
(checked against transformers' own modules where it is installed), explicit dims, bad input."""

from __future__ import annotations

import json

import pytest

from fp4offload.errors import ConfigError
from fp4offload._planner.models import (PRESETS, PUBLISHED_ACTIVE, PUBLISHED_TOTALS, ModelSpec, from_hf_config,
                                       parse_dims, resolve_model)

REQUIRED = ("llama-3.1-8b", "llama-3.1-70b", "llama-4-scout-17b-16e", "qwen3-32b", "mixtral-8x7b")


def test_required_presets_exist_and_every_preset_has_a_published_total():
    assert set(REQUIRED) <= set(PRESETS)
    assert set(PRESETS) == set(PUBLISHED_TOTALS)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_parameter_count_matches_published_total_within_1_percent(name):
    n = PRESETS[name].param_count()
    assert abs(n / PUBLISHED_TOTALS[name] - 1) <= 0.01, f"{name}: {n:,} vs {PUBLISHED_TOTALS[name]:,.0f}"


@pytest.mark.parametrize("name", sorted(PUBLISHED_ACTIVE))
def test_moe_active_parameters_match_published_figures(name):
    # Published active counts are rounded to two or three digits.
    n = PRESETS[name].active_param_count()
    assert abs(n / PUBLISHED_ACTIVE[name] - 1) <= 0.03, f"{name}: {n:,}"


def test_exact_counts_of_well_known_checkpoints():
    assert PRESETS["llama-3.1-8b"].param_count() == 8_030_261_248
    assert PRESETS["llama-3.1-70b"].param_count() == 70_553_706_496
    assert PRESETS["mixtral-8x7b"].param_count() == 46_702_792_704
    assert PRESETS["gpt2"].param_count() == 124_439_808
    assert PRESETS["llama-4-scout-17b-16e"].param_count() == 108_641_793_536


# Field values of the published config.json files (facts), as the Hub serves them.
HUB_CONFIGS = {
    "llama-3.1-8b": {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
                     "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False},
    "mistral-7b": {"model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32768},
    "qwen2.5-7b": {"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064,
                   "tie_word_embeddings": False},
    "qwen3-32b": {"model_type": "qwen3", "hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 64,
                  "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 25600, "vocab_size": 151936,
                  "tie_word_embeddings": False, "attention_bias": False},
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                      "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
                      "tie_word_embeddings": False},
    "gemma-2-9b": {"model_type": "gemma2", "hidden_size": 3584, "num_hidden_layers": 42, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "head_dim": 256, "intermediate_size": 14336, "vocab_size": 256000},
    "gpt2": {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024, "n_inner": None,
             "vocab_size": 50257},
    "mixtral-8x7b": {"model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "intermediate_size": 14336, "num_local_experts": 8,
                     "num_experts_per_tok": 2, "vocab_size": 32000, "tie_word_embeddings": False},
    "llama-4-scout-17b-16e": {
        "model_type": "llama4", "tie_word_embeddings": False,
        "text_config": {"model_type": "llama4_text", "hidden_size": 5120, "num_hidden_layers": 48,
                        "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
                        "intermediate_size": 8192, "intermediate_size_mlp": 16384, "num_local_experts": 16,
                        "num_experts_per_tok": 1, "interleave_moe_layer_step": 1, "moe_layers": list(range(48)),
                        "vocab_size": 202048, "use_qk_norm": True},
        "vision_config": {"hidden_size": 1408, "image_size": 336, "intermediate_size": 5632, "num_attention_heads": 16,
                          "num_channels": 3, "num_hidden_layers": 34, "patch_size": 14, "pixel_shuffle_ratio": 0.5,
                          "projector_input_dim": 4096, "projector_output_dim": 4096, "vision_output_dim": 4096},
    },
}


@pytest.mark.parametrize("name", sorted(HUB_CONFIGS))
def test_hub_config_json_parses_to_the_preset(tmp_path, name):
    path = tmp_path / name / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(HUB_CONFIGS[name]))
    for source in (path, path.parent):  # the file or its folder
        spec = from_hf_config(source)
        assert spec.param_count() == PRESETS[name].param_count()
        assert spec.active_param_count() == PRESETS[name].active_param_count()
        assert spec.block_class == PRESETS[name].block_class
    assert resolve_model(str(path)).param_count() == PRESETS[name].param_count()


def test_llama4_interleaved_moe_layers_from_the_step():
    text = dict(HUB_CONFIGS["llama-4-scout-17b-16e"]["text_config"])
    text.pop("moe_layers")
    text["interleave_moe_layer_step"] = 2
    spec = from_hf_config({"model_type": "llama4_text", **text})
    assert spec.moe_layers == tuple(range(1, 48, 2))
    assert spec.is_moe_layer(1) and not spec.is_moe_layer(0)


# Tiny configs of every supported architecture: the count must equal transformers' own modules.
TINY = {
    "llama": dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=96, vocab_size=128, tie_word_embeddings=False),
    "llama-bias": dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=96, vocab_size=128, attention_bias=True,
                       mlp_bias=True),
    "mistral": dict(model_type="mistral", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=96, vocab_size=128),
    "qwen2": dict(model_type="qwen2", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=96, vocab_size=128, tie_word_embeddings=False),
    "qwen3": dict(model_type="qwen3", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, intermediate_size=96, vocab_size=128, tie_word_embeddings=False),
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, intermediate_size=96, moe_intermediate_size=24,
                      num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[1],
                      vocab_size=128, tie_word_embeddings=False),
    "qwen2_moe": dict(model_type="qwen2_moe", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=96, moe_intermediate_size=24,
                      shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2, vocab_size=128),
    "gemma": dict(model_type="gemma", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=32, intermediate_size=96, vocab_size=128),
    "gemma2": dict(model_type="gemma2", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, intermediate_size=96, vocab_size=128),
    "gemma3_text": dict(model_type="gemma3_text", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32, intermediate_size=96, vocab_size=128),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=32),
    "mixtral": dict(model_type="mixtral", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                    vocab_size=128),
    "llama4_text": dict(model_type="llama4_text", hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, intermediate_size=32, intermediate_size_mlp=96,
                        num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2, vocab_size=128),
}


@pytest.fixture(scope="module")
def transformers_mod():
    return pytest.importorskip("transformers")


@pytest.mark.parametrize("arch", sorted(TINY))
def test_counts_equal_transformers_modules(transformers_mod, arch):
    import torch

    cfg = transformers_mod.AutoConfig.for_model(**TINY[arch])
    with torch.device("meta"):
        model = transformers_mod.AutoModelForCausalLM.from_config(cfg)
    expected = sum(p.numel() for p in model.parameters())
    assert from_hf_config(cfg.to_dict()).param_count() == expected
    assert from_hf_config(TINY[arch]).param_count() == expected  # the plain dict, as config.json holds it


def test_llama4_vision_tower_equals_transformers(transformers_mod):
    import torch

    text = {k: v for k, v in TINY["llama4_text"].items() if k != "model_type"}
    vision = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, image_size=56,
                  patch_size=14, pixel_shuffle_ratio=0.5, projector_input_dim=48, projector_output_dim=48,
                  vision_output_dim=48, num_channels=3)
    cfg = transformers_mod.Llama4Config(text_config=text, vision_config=vision)
    with torch.device("meta"):
        model = transformers_mod.Llama4ForConditionalGeneration(cfg)
    assert from_hf_config(cfg.to_dict()).param_count() == sum(p.numel() for p in model.parameters())


def test_explicit_dims():
    spec = parse_dims("hidden=4096,layers=32,heads=32,kv_heads=8,ffn=14336,vocab=128256")
    assert spec.param_count() == PRESETS["llama-3.1-8b"].param_count()
    moe = parse_dims("hidden=4096,layers=32,heads=32,kv_heads=8,ffn=14336,vocab=32000,experts=8,top_k=2,name=mx")
    assert moe.param_count() == PRESETS["mixtral-8x7b"].param_count() and moe.name == "mx"
    assert resolve_model("hidden=768,layers=12,heads=12,ffn=3072,vocab=50257,tied=1").tied


@pytest.mark.parametrize("text, key", [
    ("llama-9000", "--model"),
    ("hidden=4096,layers=32", "--model heads"),
    ("hidden=4096,layers=x,heads=32,ffn=1,vocab=2", "--model layers"),
    ("hidden=4096,depth=3", "--model depth"),
    ("hidden=4096 layers=3", "--model hidden"),
    ("hidden=64,layers=2,heads=3,ffn=8,vocab=10,kv_heads=2", "model.kv_heads"),
    ("hidden=64,layers=0,heads=4,ffn=8,vocab=10", "model.layers"),
])
def test_bad_model_specs_raise_config_errors(text, key):
    with pytest.raises(ConfigError) as e:
        resolve_model(text)
    assert e.value.key == key, str(e.value)


def test_bad_config_json(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        from_hf_config(p)
    p.write_text(json.dumps({"model_type": "mamba", "d_model": 768}))
    with pytest.raises(ConfigError) as e:
        from_hf_config(p)
    assert e.value.key == "model_type"
    p.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ConfigError) as e:
        from_hf_config(p)
    assert e.value.key == "num_attention_heads"
    with pytest.raises(ConfigError):
        from_hf_config(tmp_path / "nothing-here.json")


def test_flops_and_activations_scale_as_expected():
    m = PRESETS["llama-3.1-8b"]
    f = m.train_flops_per_token(4096)
    assert 6 * 7.5e9 < f < 6 * 8.5e9 + 6 * 32 * 4096 * 4096 * 1.01
    assert m.train_flops_per_token(4096, recompute=True) > 1.3 * m.train_flops_per_token(4096) * 0.95
    assert m.saved_bytes_per_token(4) > m.saved_bytes_per_token(2)
    moe = PRESETS["mixtral-8x7b"]
    assert moe.matmul_params_per_token() < 0.3 * moe.param_count()  # two of eight experts run
    assert isinstance(m, ModelSpec) and "8.03B" in m.describe()
