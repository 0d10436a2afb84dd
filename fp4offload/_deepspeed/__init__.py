"""The DeepSpeed block's implementation, one idea per module; :mod:`fp4offload.deepspeed` is its public face.

- ``config``: the block read from a DeepSpeed config, rewritten and checked (``prepare_config``), the host
  settings with their environment overrides;
- ``internals``: every private DeepSpeed name the block patches or reads (ZeRO-3's parameter attributes
  included), in one table, with the only accessors to them and the check run at initialize;
- ``engine``: ``initialize`` in order, ``install`` and the start-up hook's state;
- ``surgeries``: what the block does to DeepSpeed around ``deepspeed.initialize``, one record per change in one
  table (when it applies, the private names it needs, its steps before and after), and what ``initialize``
  attaches to the engine;
- ``preflight``: the host-memory estimate checked against what the process may allocate;
- ``host``: the process-level host settings (glibc's mmap threshold, the host allocator cache);
- ``at_init``: DeepSpeed methods replaced while ``deepspeed.initialize`` runs;
- ``zero12``: ZeRO-1/2's bf16 host gradient partition and staging buffers, a compact master as the model's
  own bf16 partition;
- ``zero3``: ZeRO-3's master gradients as slices of its gradient partition, and clipping applied in fp32;
- ``weights``: packed NVFP4 weight shards under ZeRO-3;
- ``monitor``: the counters written through the engine's monitor.

The optimizer the block builds comes from :mod:`fp4offload._deepspeed.optim`. No module here imports
deepspeed at import time.
"""
