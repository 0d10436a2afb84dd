"""``Policy.auto()`` (``auto: true`` in the policy YAML): the optimizer's master form and where its states live,
chosen when ``apply`` runs, from the model, the mesh and the live readings.

The candidates, from the least lossy to the most and, within a master form, the states beside the shards before
the states in host RAM (the faster first):

1. the fp32 master with NVFP4 states beside the shards, then (shards on a GPU) in host RAM;
2. split (bf16 shards and a 16-bit residual: the fp32 master exactly; bf16 gradients), the same two places;
3. the bf16 master (stochastic rounding), the same two places.

A compact master needs plain weight gathers and bf16 compute; with the policy's ``weights`` packing, only the
fp32 candidates run (the others are named with the reason). Each candidate's bytes per rank are counted where
they live: the shard (4 or 2 B/param of the rank's shard), split's residual (2), the sharded gradient (as the
shard), the packed states (1.13), the gathered bf16 weights of the two largest blocks and of the root's own
parameters, and the allowance the DeepSpeed model keeps for ZeRO-3, which shards the same way
(``host_model.UNMODELLED["zero3"]``). Shards on a GPU (no ``cpu_offload``) count against that GPU's free memory
(pynvml, :mod:`fp4offload._machine`), everything else against the host RAM this process may use over the
node's local ranks. Rank 0 decides; every rank builds the same policy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from fp4offload._autochoice import Candidate, Decision, gib, on_rank_0
from fp4offload._config import OptimizerStatesConfig
from fp4offload._memory.host_model import UNMODELLED
from fp4offload._memory.sizes import STATE_BYTES
from fp4offload.errors import CapacityError

__all__ = ["candidates", "estimate", "choose", "decide"]


def candidates(policy: Any, on_gpu: bool) -> list[tuple[Candidate, str]]:
    """(candidate, why it cannot run or ``""``) in the order of preference. A candidate's block is the
    ``optimizer_states`` it sets."""
    st = policy.optimizer_states or OptimizerStatesConfig()
    places = ("same", "cpu") if on_gpu else ("same",)
    out = []
    for master in ("fp32", "split", "bf16"):
        why = ""
        if master != "fp32" and policy.packs_weights:
            why = "a compact master needs plain weight gathers (weights packs from an fp32 shard)"
        elif master != "fp32" and policy.param_dtype != torch.bfloat16:
            why = "a compact master needs param_dtype bfloat16"
        for place in places:
            where = {"same": "beside the shards", "cpu": "in host RAM"}[place]
            states = dataclasses.replace(st, format="nvfp4", master=master, device=place, nvme_path=None,
                                         master_device="same")
            out.append((Candidate(f"{master} master, NVFP4 states {where}", {"optimizer_states": states}), why))
    return out


def estimate(policy: Any, states: OptimizerStatesConfig, params: int, world: int, gathered: int, on_gpu: bool
             ) -> tuple[int, int]:
    """(device bytes, host bytes) of one rank for ``policy`` with ``states`` (see the module docstring)."""
    local = -(-params // world)
    compact = states.master != "fp32"
    shard = (2 if compact else 4) * local
    residual = 2 * local if states.master == "split" else 0
    grads = shard
    packed = STATE_BYTES["nvfp4"] * local
    fixed, per_param = UNMODELLED["zero3"]
    allowance = fixed + per_param * local
    shards_on_device = on_gpu and not policy.cpu_offload
    device = host = 0.0
    if shards_on_device:
        device += shard + residual + grads + 2 * gathered
        if states.device == "cpu":
            host += packed
        else:
            device += packed
        host += allowance
    else:
        host += shard + residual + grads + packed + allowance
        if on_gpu:
            device += 2 * gathered
        else:
            host += 2 * gathered
    return int(device), int(host)


def _gathered(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> int:
    """Elements gathered at once: the two largest blocks (one in compute, one prefetched) and the root's own."""
    sizes = sorted((sum(p.numel() for p in b.parameters()) for _, b in blocks), reverse=True)
    in_blocks = {id(p) for _, b in blocks for p in b.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)
    return sum(sizes[:2]) + root


def choose(model: nn.Module, policy: Any, blocks: list[tuple[str, nn.Module]], world: int, on_gpu: bool, *,
           host_free: int | None = None, host_source: str = "", device_free: int | None = None,
           device_source: str = "", local_ranks: int | None = None) -> Decision:
    """The decision on this process: ``decision.choice.block["optimizer_states"]`` is the states to run."""
    from fp4offload import _machine

    if host_free is None:
        lim = _machine.limits()
        host_free, host_source = lim.free, lim.describe()
    if local_ranks is None:
        local_ranks = _machine.launcher_ranks().local
    if on_gpu and device_free is None:
        dev = torch.cuda.current_device()
        free, _total = torch.cuda.mem_get_info(dev)
        device_free, device_source = int(free), f"cuda:{dev} free (torch.cuda.mem_get_info)"
    params = sum(p.numel() for p in model.parameters())
    gathered = _gathered(model, blocks)
    host_free_rank = host_free // max(1, local_ranks)
    decision = Decision(choice=None, free=host_free, source=host_source + (
        f"; device {gib(device_free)} ({device_source})" if on_gpu else ""))
    best = None
    for cand, why in candidates(policy, on_gpu):
        if why:
            decision.tried.append((cand.name, None, why))
            continue
        states = cand.block["optimizer_states"]
        device, host = estimate(policy, states, params, world, gathered, on_gpu)
        over = max(host - host_free_rank, 0) + (max(device - (device_free or 0), 0) if on_gpu else 0)
        if best is None or over < best[0]:
            best = (over, cand.name, host * local_ranks)
        if over == 0:
            decision.choice, decision.estimate, decision.need = cand, host, host * local_ranks
            decision.tried.append((cand.name, host, ""))
            return decision
        short = [f"host {gib(host)} per rank of {gib(host_free_rank)}"] if host > host_free_rank else []
        if on_gpu and device > (device_free or 0):
            short.append(f"device {gib(device)} of {gib(device_free or 0)}")
        decision.tried.append((cand.name, host, "would need " + " and ".join(short)))
    tried = "; ".join(f"{n}: {w}" for n, _, w in decision.tried)
    raise CapacityError(f"{params / 1e6:.1f}M parameters over {world} rank(s) with Policy.auto()",
                        best[2] if best else 0, host_free,
                        f"the smallest candidate is {best[1] if best else 'none'}; tried: {tried}. More ranks, "
                        "cpu_offload, a smaller model or more memory")


def decide(model: nn.Module, policy: Any, blocks: list[tuple[str, nn.Module]], world: int, on_gpu: bool
           ) -> tuple[Any, Decision]:
    """:func:`choose` on rank 0, broadcast to every rank (the decision only: a policy may hold a callable);
    returns the policy with the chosen states and ``automatic`` off, and the decision."""
    decision = on_rank_0(lambda: choose(model, policy, blocks, world, on_gpu))
    states = decision.choice.block["optimizer_states"]
    return dataclasses.replace(policy, optimizer_states=states, automatic=False), decision
