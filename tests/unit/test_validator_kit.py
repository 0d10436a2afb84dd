"""One validator kit (fp4offload/_config/checks.py): a mistake reads the same from the DeepSpeed JSON block, the
FSDP2 policy, FP4AdamW's Python arguments, the codec and the CLI: the same "expected ..." text and the same hint,
under each surface's own name for the key."""

from __future__ import annotations

import json

import pytest
import torch

from fp4offload import FP4AdamW, quantize
from fp4offload._config import parse_block, parse_fsdp_policy
from fp4offload._optim.options import NvmeOptions, StateFormat, StepOptions
from fp4offload.cli import main
from fp4offload.errors import ConfigError


def _error(fn) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        fn()
    return e.value


def _tail(e: ConfigError) -> str:
    """The message after the key and value: what is allowed and the hint."""
    return str(e).split(" is not allowed; ", 1)[1]


def _p():
    return [torch.nn.Parameter(torch.zeros(8))]


SAME = {  # the one mistake, made on each surface
    "v_format": [lambda: parse_block({"optimizer_states": {"v_format": "ue2m3"}}),
                 lambda: parse_fsdp_policy({"optimizer_states": {"v_format": "ue2m3"}}),
                 lambda: FP4AdamW(_p(), state_format=StateFormat(v_format="ue2m3"))],
    "rounding": [lambda: parse_block({"optimizer_states": {"rounding": "stochastik"}}),
                 lambda: FP4AdamW(_p(), state_format=StateFormat(m_rounding="stochastik")),
                 lambda: quantize(torch.ones(16), "nvfp4", rounding="stochastik")],
    "device": [lambda: parse_block({"optimizer_states": {"device": "nvem"}}),
               lambda: FP4AdamW(_p(), state_device="nvem")],
    "master": [lambda: parse_block({"optimizer_states": {"master": "spilt"}}),
               lambda: FP4AdamW(_p(), master="spilt")],
    "master_device": [lambda: parse_block({"optimizer_states": {"master_device": "nvm"}}),
                      lambda: NvmeOptions(master_device="nvm")],
    "a bool": [lambda: parse_block({"host": {"share_bf16_staging": "yes"}}),
               lambda: StepOptions(skip_nonfinite="yes")],
    "an integer": [lambda: parse_block({"optimizer_states": {"min_numel": "4096"}}),
                   lambda: StateFormat(min_numel="4096")],
}


@pytest.mark.parametrize("mistake", sorted(SAME))
def test_one_mistake_reads_the_same_on_every_surface(mistake):
    errors = [_error(fn) for fn in SAME[mistake]]
    tails = {_tail(e).replace(">= 0", ">= N").replace(">= 1", ">= N") for e in errors}
    assert len(tails) == 1, [str(e) for e in errors]


def test_a_close_word_is_offered_everywhere():
    for fn in SAME["device"] + SAME["master"]:
        assert "did you mean" in str(_error(fn))


def test_the_cli_words_its_flags_as_the_kit_does(capsys, tmp_path):
    assert main(["plan", "--format", "tabel", "--gpu", "h100-80gb"]) == 2
    cli = capsys.readouterr().err.strip()
    assert cli.endswith(": --format='tabel' is not allowed; expected one of 'table', 'json'. did you mean 'table'?")
    cfg = tmp_path / "ds.json"  # the same slip in a config the CLI checks reads as it does in Python
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1,
                               "fp4offload": {"optimizer_states": {"device": "nvem"}}}))
    assert main(["plan", "--check", str(cfg), "--model", "hidden=64,layers=2,heads=4,ffn=128,vocab=256"]) == 2
    err = capsys.readouterr().err
    assert _tail(_error(SAME["device"][1])) in err, err
