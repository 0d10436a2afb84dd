"""Storage shared by FP4AdamW's NVMe tier (fp4offload/_optim/nvme.py) and the activations' NVMe files
(fp4offload/_offload/nvme_store.py), and the host memory both use.

- folder.py: a store's folder: made per store (mode 0700) with a lock file naming its process, removed at close,
  collection or exit, kept on request (a ``KEEP`` mark); folders of dead processes swept when a store starts;
- engines.py: the I/O engines, ``"threads"`` (buffered, through the container module) and ``"aio"`` (DeepSpeed's
  async_io op, O_DIRECT), ``"auto"`` choosing aio when it loads and a probe works, and the worker threads that read
  ahead and write behind; aio.py: the aio op, the direct-I/O layout of a container file, its reads and writes;
- segment.py: one segment file: names by key, segment and generation, the disk space it may take, its header's
  identity; the bytes are fp4offload's checksummed container (formats/container.py);
- txn.py: transactions: space checked and reserved up front, generations committed or aborted whole, undo files;
- pinned.py: host memory: the bounded slab pool (pinned when CUDA is present) and the aio engine's page-locked
  buffers, with one count of the page-locked bytes of the process.

A lower layer: it imports ``formats``, ``errors`` and ``_machine`` of the project, never ``_optim``, ``_offload``,
``_fsdp`` or ``_deepspeed``; those import it. What a client keeps in its files (FP4AdamW: which tensors of a
parameter go in a segment, its header fields, the manifest of a kept folder) stays with the client.
"""
