"""``"fp4offload": {"auto": true}``: the block picks itself from the live readings and the model.

At ``initialize``, with the model in hand, :func:`choose` walks the candidates from the least lossy to the most,
and, within one master form, from the fastest to the slowest (host RAM before NVMe):

1. the fp32 master with NVFP4 states;
2. the split master (a bf16 partition and a 16-bit residual: bit-exact with fp32) with NVFP4 states;
3. split with the states and its residual on NVMe, when an NVMe folder is known (DeepSpeed's
   ``offload_optimizer.nvme_path`` or the block's ``nvme_path``);
4. the bf16 master with NVFP4 states;
5. the bf16 master with the states on NVMe, when a folder is known.

Each candidate is the block a user would write; it goes through the same ``prepare_config`` and the same
host-memory model as the preflight (:mod:`fp4offload._deepspeed.preflight`), against the same limit
(:func:`fp4offload._machine.limits`). The first that fits with :data:`SPARE_PER_RANK` to spare is the choice. One
line names it, its estimate, the limit, and each candidate before it with why it did not fit;
``engine.fp4offload.auto`` keeps the :class:`Decision` and ``engine.fp4offload.block`` the block that ran. When none
fits, CapacityError names the smallest estimate with the spare, and the limit. Rank 0 decides and broadcasts its
choice, so every rank builds the same block.

The block is the object ``{"auto": true, "nvme_path": ..., "host": {...}, "monitor": {...}}``: ``nvme_path``
lets the NVMe candidates run, ``host`` and ``monitor`` are kept in the chosen block as written. The string
``"auto"`` is refused with that form as the fix: the Hugging Face Trainer and Accelerate treat every ``"auto"``
string in a DeepSpeed config as a value for them to fill, and stop on this one before DeepSpeed starts, so a config
written with it would work under ``deepspeed`` and fail under the launcher most users have.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

from fp4offload._autochoice import Candidate, Decision, gib as _gib, on_rank_0
from fp4offload.errors import CapacityError, ConfigError

from .config import BLOCK_KEY, _zero, prepare_config

__all__ = ["is_auto", "auto_options", "STRING_FORM_FIX", "Candidate", "Decision", "candidates", "choose", "decide",
           "AUTO_KEYS", "SPARE_PER_RANK"]

#: keys the object form of an auto block takes
AUTO_KEYS = ("auto", "nvme_path", "host", "monitor")
#: What a choice must leave unclaimed beyond its estimate, per local rank. The process grows between the choice and
#: initialize's preflight (prepare_config, DeepSpeed's modules: 6 to 7 MiB on one CPU rank, 2026-12-05), and that
#: preflight reads the limit again: a choice that fitted by less would be refused by it a moment later.
SPARE_PER_RANK = 32 << 20
def is_auto(block: Any) -> bool:
    """Whether a config's ``"fp4offload"`` value asks for the automatic choice."""
    return block == "auto" or (isinstance(block, Mapping) and "auto" in block)


#: why the string form is refused, and the form that works under every launcher
STRING_FORM_FIX = ('write "fp4offload": {"auto": true}: the Hugging Face Trainer and Accelerate fill every "auto" '
                   "string of a DeepSpeed config themselves and stop on this one; the object form passes every "
                   "launcher")


def auto_options(block: Any) -> dict:
    """The object form's keys, checked; the string form refused with the object form as its fix."""
    if block == "auto":
        raise ConfigError(BLOCK_KEY, "auto", '{"auto": true}', STRING_FORM_FIX)
    opts = dict(block)
    if opts.get("auto") is not True:
        raise ConfigError(f"{BLOCK_KEY}.auto", opts.get("auto"), "true",
                          'write "fp4offload": {"auto": true, ...}; to choose by hand drop "auto" and '
                          "name optimizer_states")
    extra = sorted(set(opts) - set(AUTO_KEYS))
    if extra:
        raise ConfigError(f"{BLOCK_KEY}.{extra[0]}", opts[extra[0]], "one of " + ", ".join(AUTO_KEYS) + " with auto",
                          "auto chooses optimizer_states itself; write the block by hand to set other keys")
    path = opts.get("nvme_path")
    if path is not None and (not isinstance(path, str) or not path):
        raise ConfigError(f"{BLOCK_KEY}.nvme_path", path, "a folder path (a non-empty string)",
                          "the NVMe folder the NVMe candidates put the states in")
    return opts


def candidates(ds: Mapping[str, Any], opts: Mapping[str, Any]) -> list[Candidate]:
    """The candidates for DeepSpeed config ``ds`` (without the block), in the order of preference."""
    off = _zero(dict(ds)).get("offload_optimizer")  # read only
    off = off if isinstance(off, Mapping) else {}
    offloaded = off.get("device") in ("cpu", "nvme")
    nvme_path = opts.get("nvme_path") or (off.get("nvme_path") if off.get("device") == "nvme" else None)
    ram = "cpu" if offloaded else "same"

    def states(master: str, device: str, **kw: Any) -> dict:
        st = {"format": "nvfp4", "device": device, **kw}
        if master != "fp32":
            st["master"] = master
        return st

    out = [Candidate("fp32 master, NVFP4 states" + (" in host RAM" if offloaded else ""),
                     {"optimizer_states": states("fp32", ram)}),
           Candidate("split master, NVFP4 states in host RAM", {"optimizer_states": states("split", ram)})]
    if nvme_path:
        out.append(Candidate("split master, NVFP4 states and the residual on NVMe",
                             {"optimizer_states": states("split", "nvme", nvme_path=nvme_path, master_device="nvme")}))
    out.append(Candidate("bf16 master, NVFP4 states in host RAM", {"optimizer_states": states("bf16", ram)}))
    if nvme_path:
        out.append(Candidate("bf16 master, NVFP4 states on NVMe",
                             {"optimizer_states": states("bf16", "nvme", nvme_path=nvme_path)}))
    for c in out:
        for key in ("host", "monitor"):
            if key in opts:
                c.block[key] = copy.deepcopy(opts[key])
    return out


def choose(ds_config: Mapping[str, Any], model: Any, *, lim: Any = None, rss: int | None = None,
           world: int | None = None, local_ranks: int | None = None, accelerator: str | None = None
           ) -> tuple[dict, Decision]:
    """The config with the chosen block in place of ``"auto"``, and the decision, on this process alone.

    ``model``: a torch module, or ``(parameters, bytes of them in host RAM)``. The other arguments default to
    the live readings (:mod:`fp4offload._machine`) and the launcher's environment."""
    from . import preflight

    raw = copy.deepcopy(dict(ds_config))
    opts = auto_options(raw.get(BLOCK_KEY))
    raw.pop(BLOCK_KEY, None)
    params, held = model if isinstance(model, tuple) else preflight.model_bytes(model)
    lim = preflight.limits() if lim is None else lim
    decision = Decision(choice=None, free=lim.free, source=lim.describe())
    best: tuple[int, str] | None = None
    for cand in candidates(raw, opts):
        cfg = copy.deepcopy(raw)
        cfg[BLOCK_KEY] = copy.deepcopy(cand.block)
        try:
            prepared = prepare_config(cfg)
        except ConfigError as exc:
            decision.tried.append((cand.name, None, f"not for this config: {exc}"))
            continue
        est = preflight.estimate(prepared.ds_config, (params, held), prepared.host, rss=rss, world=world,
                                 local_ranks=local_ranks, accelerator=accelerator, states=prepared.states)
        need = max(0, est.added - held) * est.local_ranks
        spare = SPARE_PER_RANK * est.local_ranks
        if best is None or need + spare < best[0]:
            best = (need + spare, cand.name)
        if need + spare <= lim.free:
            decision.choice, decision.estimate, decision.need, decision.spare = cand, est.per_rank, need, spare
            decision.tried.append((cand.name, need, ""))
            return cfg, decision
        short = "" if need > lim.free else f", leaving under the {spare >> 20} MiB spare auto keeps"
        decision.tried.append((cand.name, need, f"would add {_gib(need)} on this node{short}"))
    tried = "; ".join(f"{n}: {why}" for n, _, why in decision.tried)
    if best is None:
        raise ConfigError(BLOCK_KEY, "auto", "a DeepSpeed config one of the candidates can run with",
                          f"no candidate block suits it ({tried}); write the block by hand")
    on_nvme = any("NVMe" in n for n, _, _ in decision.tried)
    raise CapacityError(f'host RAM for {params / 1e6:.1f}M parameters with "fp4offload": {{"auto": true}}', best[0],
                        lim.free,
                        f"the smallest candidate is {best[1]} (its estimate and the {SPARE_PER_RANK >> 20} MiB per "
                        f"rank auto keeps spare); tried: {tried}. The process may use "
                        f"{lim.describe()}: more nodes, a smaller model, more RAM"
                        + ("" if on_nvme else " or an NVMe folder (nvme_path)"))


def decide(ds_config: Mapping[str, Any], model: Any) -> tuple[dict, Decision]:
    """:func:`choose` on rank 0, broadcast to the others (each rank then prepares the same block); ``choose`` on
    this process alone when the process group is not up or has one rank."""
    return on_rank_0(lambda: choose(ds_config, model))
