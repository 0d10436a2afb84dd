"""FSDP2 policies behind :mod:`fp4offload.fsdp`, one idea per module: ``apply`` (the policy applied: the shard
wrappers and the NVFP4 all-gathers), ``policy``, ``internals`` (every private torch FSDP2/DTensor name), ``weight``
(``FP4Weight`` and the all-gather hooks), ``optim`` (FP4AdamW over local shards), ``checkpoint`` (DCP), ``accelerate``
(Hugging Face Accelerate)."""
