"""What several test files share (tests/conftest.py puts tests/ on sys.path, so ``from helpers.dist import ...``
works from every folder):

- ``dist``: ``run_ranks`` (N gloo ranks of a function, hard timeouts, process groups and temp dirs cleaned up)
- ``deepspeed``: the DeepSpeed configs and loss-curve tolerance, and ``launch`` (ranks of tests/scripts/ workers)
- ``fsdp``: the odd-shaped FSDP2 model and the unsharded tensor a policy should rebuild
- ``optim_cases``: the fused-step checks (a fused step against the reference, byte for byte) run on every backend
- ``extensions``: the fused-step extensions, the CPU paths, and skips that name a missing system library
- ``codec_data``, ``formulas``, ``activations``: codec inputs, the formats' published definitions, a tiny Llama
- ``plan``: the planner's runs of a two-bit option; ``pretrained``: SmolLM2-135M, loaded or skipped with the fix
"""
