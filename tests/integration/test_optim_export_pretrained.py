"""The way back to torch AdamW on a real pretrained transformer (SmolLM2-135M, its real attention): after FP4AdamW's
steps, the torch AdamW that fp4offload.to_torch_adamw returns moves every weight as FP4AdamW's next step would."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from fp4offload import FP4AdamW, to_torch_adamw  # noqa: E402
from helpers.pretrained import load_smollm2  # noqa: E402

pytestmark = pytest.mark.slow


def test_smollm2_steps_on_under_torch_adamw_as_under_fp4adamw():
    from benchmarks import accuracy_downstream as ad
    from benchmarks import activation_classes as ac

    n_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = load_smollm2()
        x, y = ac._batch()
        x, y = x[:4], y[:4]
        params = [p for p in model.parameters() if p.requires_grad]

        def backward():
            model.zero_grad(set_to_none=True)
            F.cross_entropy(ad.last_logits(model, x).float(), y).backward()

        opt = FP4AdamW(params, lr=1e-4, weight_decay=0.1)
        for _ in range(2):
            backward()
            opt.step()
        adamw = to_torch_adamw(opt)
        assert sum(1 for p in params if float(adamw.state[p]["step"]) == 2) == len(params)
        start = [p.detach().clone() for p in params]
        backward()
        grads = [p.grad.clone() for p in params]
        adamw.step()
        moved_torch = [p.detach() - w for p, w in zip(params, start)]
        with torch.no_grad():
            for p, w, g in zip(params, start, grads):
                p.copy_(w)
                p.grad = g
        opt.step()
        err = [float((a - (p.detach() - w)).norm() / (p.detach() - w).norm())
               for a, p, w in zip(moved_torch, params, start)]
        worst = max(err)
        print(f"SmolLM2-135M, {len(params)} tensors: one step's update under torch AdamW against FP4AdamW, "
              f"worst relative difference {worst:.2e}, median {sorted(err)[len(err) // 2]:.2e}")
        assert worst < 5e-4, (worst, sorted(err)[-5:])  # 2.2e-5 measured (2026-12-06): fp32 rounding apart
        opt.close()
    finally:
        torch.set_num_threads(n_threads)
