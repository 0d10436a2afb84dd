"""Where one FP4AdamW's states live, and the step as a transaction: :class:`Placement`.

Owns the optimizer's state tier (tiers.py: beside the parameters, in host RAM, or in NVMe files), the step's
all-or-nothing transaction on a transactional tier (its disk space reserved first, what changes in place saved
in the tier's undo log, everything put back after any error), the accounting of a step's bytes and of the
bytes held by place, closing the tier, and what a copy or a pickle of the optimizer carries of states kept
outside ``optimizer.state``.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from .. import _metrics as metrics
from ..errors import ConfigError
from . import reference_step as R
from .options import NvmeOptions
from .state import PACKED_KEYS, residual_sizes, step_of
from .tiers import DeviceTier, make_tier, undo_bytes

#: (param group, parameter, its position in the optimizer's order), as a step visits them
Todo = Iterable[tuple[dict, torch.Tensor, int]]


class Placement:
    """The states of one optimizer: on `state_device` (``"same"``, ``"cpu"`` or ``"nvme"`` under `nvme_path`,
    with the settings of `nvme`); `tensor_key` and `has_states` name tensors' NVMe files (tiers.NvmeTier)."""

    def __init__(self, state_device: str, nvme_path, nvme: NvmeOptions,
                 tensor_key: Callable[[torch.Tensor], str | None] | None,
                 has_states: Callable[[torch.Tensor], bool]):
        self.state_device = state_device
        self.residuals_in_files = nvme.master_device == "nvme"
        self.tier: DeviceTier = make_tier(state_device, nvme_path=nvme_path, nvme_threads=nvme.threads,
                                          nvme_reserve_bytes=nvme.reserve_bytes, nvme_io=nvme.io,
                                          nvme_keep=nvme.keep, residuals=self.residuals_in_files,
                                          tensor_key=tensor_key, has_states=has_states)

    # ---- the tier, as the optimizer, conversions and tests reach it ---------------------------------------

    @property
    def store(self):
        """The NVMe tier's NvmeStore (None on the other tiers, or once closed)."""
        return self.tier.store

    @property
    def keys(self):
        """tensor -> key of its NVMe files (None on the other tiers)."""
        return getattr(self.tier, "keys", None)

    def key(self, p) -> str:
        """The key of p's NVMe files (NVMe tier only)."""
        return self.tier.key(p)

    @property
    def nvme_io(self) -> str | None:
        """The NVMe store's I/O engine, ``"aio"`` or ``"threads"`` (None on the other tiers)."""
        return None if self.tier.store is None else self.tier.store.io

    def compute_device(self, p) -> torch.device:
        """Where the step of `p` runs."""
        return self.tier.compute_device(p)

    def states(self, st: dict, p) -> tuple[R.Packed, R.Packed]:
        """p's whole packed (m, v) (`st`: its ``optimizer.state`` entry): the live tensors in RAM, copies read
        from the files on the NVMe tier."""
        return self.tier.states(st, p)

    def states_and_residual(self, st: dict, p) -> tuple[R.Packed, R.Packed, tuple | None]:
        """As :meth:`states`, with split's whole residual ``(lo, odd)`` where the files keep it (else None)."""
        return self.tier.states_and_residual(st, p)

    def sync(self) -> None:
        """Wait for pending writes (the NVMe tier's)."""
        self.tier.sync()

    # ---- the step ---------------------------------------------------------------------------------------

    def run_step(self, todo: list, state: dict, is_packed: Callable[[dict, torch.Tensor], bool],
                 step_all: Callable[[], None], undone: Callable[[], None]) -> None:
        """Run `step_all` (the step of every parameter in `todo`; `state`: ``optimizer.state``) on the tier.

        On a transactional tier (NVMe) all of it lands, or none of it: the disk space of the whole step (every
        packed parameter's new files, and the undo log's share) is checked and reserved first (CapacityError
        there changes nothing); the new states go to a new generation of files, switched in once every write
        landed; what the step changes in place (weights, masters, residuals, small fp32 states) is saved in the
        tier's undo log just before it changes (in host RAM up to ``tiers.UNDO_RAM_BYTES``, 256 MiB, beyond it on
        the state disk). After any error the step is undone (weights and in-place states
        restored, fresh states dropped, the new files deleted), `undone` puts back what the optimizer counts
        (step counts, stream numbers), and the error is re-raised: the optimizer is as before the step and
        usable once the cause is gone."""
        tier = self.tier
        if not tier.transactional:
            step_all()
            tier.end_step()
            return
        try:
            tier.begin_step(*self.step_bytes(todo, state, is_packed))
        except BaseException:
            undone()
            raise
        saved = []
        for _, p, _ in todo:
            st = state.get(p)
            saved.append((p, st, None if st is None else dict(st)))
        try:
            step_all()
            tier.finish_step()
        except BaseException:
            try:
                tier.abort_step()
            finally:
                for p, st, contents in saved:
                    if st is None:
                        state.pop(p, None)
                    else:
                        st.clear()
                        st.update(contents)
                        state[p] = st
                undone()
            raise
        tier.commit_step()

    def step_bytes(self, todo: Todo, state: dict, is_packed: Callable[[dict, torch.Tensor], bool]) -> tuple[int, int]:
        """(state-file bytes, undo bytes): at most what a transactional step over `todo` writes to disk (with
        split's residuals when the files keep them: their size is fixed, so this is exact), and what its undo
        log saves (a residual in the files needs none: it goes to the step's generation)."""
        from .nvme import tensor_disk_bytes
        from .reference_step import v_bits

        write = undo = 0
        for group, p, _ in todo:
            st = state.get(p, {})
            if is_packed(group, p):
                converts = "v_format" in st and st["v_format"] != group["v_format"]
                bits = max(v_bits(group["v_format"]), v_bits(st["v_format"]) if converts else 0)
                write += tensor_disk_bytes(p.numel(), self.residuals_in_files, bits) * (2 if converts else 1)
            # the parameter, and the states it holds that change in place (new states are dropped, not saved)
            undo += undo_bytes(p, *(st[k] for k in ("master", "master_lo", "exp_avg", "exp_avg_sq") if k in st))
        return write, undo

    # ---- bytes by place ---------------------------------------------------------------------------------

    def state_bytes(self, state: dict) -> dict[str, int]:
        """Bytes of m and v held, by place (see FP4AdamW.state_bytes); sets the optim.state_bytes.* gauges."""
        out = {"host": 0, "device": 0, "nvme": 0}
        for p, st in state.items():  # in param_groups or not (see master_bytes)
            if not torch.is_tensor(p):
                continue
            for k in (*PACKED_KEYS, "exp_avg", "exp_avg_sq"):
                t = st.get(k)
                if torch.is_tensor(t):
                    out["device" if t.is_cuda else "host"] += t.numel() * t.element_size()
        out["nvme"] = self.tier.disk_bytes()
        for k, val in out.items():
            metrics.gauge(f"optim.state_bytes.{k}").set(val)
        return out

    def master_bytes(self, state: dict) -> dict[str, int]:
        """Bytes held for master weights, by place (see FP4AdamW.master_bytes)."""
        out = {"host": 0, "device": 0, "nvme": 0}
        # every tensor with state, in param_groups or not (ZeRO-3 points the groups at a sub-group only for its step)
        for p, st in state.items():
            if not torch.is_tensor(p):
                continue
            for k in ("master", "master_lo", "master_odd"):
                t = st.get(k)
                if torch.is_tensor(t):
                    out["device" if t.is_cuda else "host"] += t.numel() * t.element_size()
            if self.residuals_in_files and "v_format" in st:
                out["nvme"] += sum(sum(residual_sizes(s1 - s0)) for s0, s1 in R.segment_ranges(p.numel()))
        return out

    def close(self, state: dict) -> None:
        """Release the tier's files and threads; a kept NVMe folder records each tensor's step (from `state`)."""
        keys = self.keys
        steps = {}
        if keys is not None and self.tier.store is not None and self.tier.store.keep:
            for t, key in list(keys.items()):
                st = state.get(t)
                if st and "step" in st:
                    steps[key] = step_of(st["step"])
        self.tier.close(steps=steps)

    # ---- copies and pickles -----------------------------------------------------------------------------

    def carried_states(self, state: dict) -> dict | None:
        """What a copy of the optimizer needs of the states kept outside `state`: on the NVMe tier each packed
        tensor's (m, v, residual or None), read back from the files; None on the other tiers."""
        if self.state_device != "nvme":
            return None
        if self.tier.store is None:
            raise ConfigError("state_device", "nvme", "an optimizer that is not closed, to copy or pickle it",
                              "close() removed its state files")
        return {p: self.tier.states_and_residual(st, p) for p, st in state.items()
                if torch.is_tensor(p) and "v_format" in st}

    def adopt(self, state: dict, carried: dict | None) -> None:
        """Take the packed states of a copied `state` into this (new) placement: `carried` (carried_states of the
        original) written to this tier's files, or host buffers page-locked again (a copied tensor is not)."""
        for p, st in list(state.items()):
            if torch.is_tensor(p) and "v_format" in st:
                if carried is not None:
                    self.tier.put(st, p, *carried[p])
                elif self.tier.pinned(p):
                    self.tier.put(st, p, *self.tier.states(st, p))


__all__ = ["Placement"]
