"""Write what a plan chose as configs the engines read: a complete DeepSpeed JSON with the
``"fp4offload"`` block, or an FSDP2 policy YAML. Every value is concrete (DeepSpeed drops "auto"
silently), the bucket sizes are the ones the memory model assumed, and the output is validated
with ``fp4offload._config`` before it is written."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp4offload._config import (ActivationsConfig, Fp4OffloadConfig, FsdpPolicyConfig, MonitorConfig,
                               OptimizerStatesConfig, WeightsConfig, dump_fsdp_policy_yaml)
from fp4offload._deepspeed.schema import validate_deepspeed_config
from fp4offload.errors import ConfigError
from fp4offload._jsonfile import write_text
from fp4offload._planner.hardware import Cluster
from fp4offload._planner.memory import TrainSetup
from fp4offload._planner.models import ModelSpec
from fp4offload._planner.strategies import Strategy

__all__ = ["OptimizerSettings", "fp4offload_block", "deepspeed_config", "fsdp_policy", "write_deepspeed",
           "write_fsdp"]


@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW hyper-parameters written into the configs (the integration builds FP4AdamW from the
    DeepSpeed ``optimizer.params`` when the block has ``optimizer_states``)."""

    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    gradient_clipping: float = 1.0


def fp4offload_block(strategy: Strategy, nvme_path: str | None = None, monitor_every: int = 10) -> Fp4OffloadConfig:
    """The fp4offload features a strategy turns on (off ones are left out; the monitor is always on)."""
    s = strategy
    opt = None
    if s.optimizer_states.format == "nvfp4":
        dev = {"gpu": "same", "cpu": "cpu", "nvme": "nvme"}[s.optimizer_states.device]
        if dev == "cpu" and s.master.device == "cpu":
            dev = "same"  # the partition the optimizer steps already lives in host RAM
        if dev == "nvme" and nvme_path is None:
            raise ConfigError("--nvme-path", None, "a directory on an NVMe drive", f"strategy {s.name} keeps "
                              "optimizer states on NVMe")
        # master_device "nvme": split's residual in the state files (the strategy puts the states on NVMe too)
        opt = OptimizerStatesConfig(format="nvfp4", device=dev, nvme_path=nvme_path if dev == "nvme" else None,
                                    master=s.master.format, master_device="nvme" if s.residual_on_nvme else "same",
                                    **({"v_format": v} if (v := s.optimizer_states.v_format) else {}))
    acts = None
    a = s.activations
    if a.device != "gpu" or a.format != "bf16":
        fmt = "none" if a.format == "bf16" else a.format
        dev = {"gpu": "same", "cpu": "cpu", "nvme": "nvme"}[a.device]
        if dev == "nvme" and nvme_path is None:
            raise ConfigError("--nvme-path", None, "a directory on an NVMe drive", f"strategy {s.name} keeps "
                              "activations on NVMe")
        acts = ActivationsConfig(format=fmt, device=dev, nvme_path=nvme_path if dev == "nvme" else None)
    weights = None
    if s.weights.format == "nvfp4":  # FSDP2 packs the all-gathers; its policy names host RAM either way
        weights = WeightsConfig(format="nvfp4", device="cpu" if s.engine == "fsdp2" else s.weights.device)
    monitor = MonitorConfig(every=monitor_every)  # always: the run reports what fp4offload saw
    return Fp4OffloadConfig(optimizer_states=opt, activations=acts, weights=weights, monitor=monitor)


def _offload(device: str, nvme_path: str | None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"device": device, "pin_memory": True}
    if device == "nvme":
        if nvme_path is None:
            raise ConfigError("--nvme-path", None, "a directory on an NVMe drive",
                              "the strategy puts DeepSpeed's offload on NVMe")
        out["nvme_path"] = str(nvme_path)  # DeepSpeed makes its own sub-folders
        out.update(extra)
    return out


def deepspeed_config(strategy: Strategy, model: ModelSpec, cluster: Cluster, setup: TrainSetup,
                     optimizer: OptimizerSettings = OptimizerSettings(),
                     nvme_path: str | None = None) -> dict[str, Any]:
    """A complete DeepSpeed config for ``strategy`` (engine deepspeed), validated."""
    s, t = strategy, setup
    if s.engine != "deepspeed":
        raise ConfigError("--emit", "deepspeed", f"a DeepSpeed strategy ({s.name} runs on {s.engine})",
                          "use --emit fsdp for FSDP2 strategies, or pick one with --strategy")
    nvme_path = nvme_path or cluster.nvme_path
    stage = s.zero_stage
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                            "reduce_bucket_size": int(t.reduce_bucket)}
    if stage in (1, 2):
        zero.update(allgather_bucket_size=int(t.allgather_bucket), reduce_scatter=True)
    if stage == 3:
        unit = model.largest_units(1)[0]
        zero.update(stage3_prefetch_bucket_size=int(t.prefetch_bucket), stage3_param_persistence_threshold=int(
            10 * model.hidden), stage3_max_live_parameters=int(unit * 2), stage3_max_reuse_distance=int(unit * 2),
            sub_group_size=int(t.sub_group_size), stage3_gather_16bit_weights_on_model_save=True)
    uses_ds_nvme = False
    if s.master.device != "gpu":
        dev = s.master.device
        zero["offload_optimizer"] = _offload(dev, nvme_path, buffer_count=t.nvme_buffer_count,
                                             fast_init=False)
        uses_ds_nvme |= dev == "nvme"
    if s.weights.device != "gpu":
        dev = s.weights.device
        zero["offload_param"] = _offload(dev, nvme_path, buffer_count=5,
                                         buffer_size=int(model.largest_units(1)[0] * 2), max_in_cpu=int(1e9))
        uses_ds_nvme |= dev == "nvme"

    if s.master.format != "fp32":  # the block's compact master runs on DeepSpeed's bf16 master mode
        if t.grad_accum != 1 or not cluster.gpu.bf16:
            raise ConfigError("--grad-accum" if t.grad_accum != 1 else "--gpu", t.grad_accum if t.grad_accum != 1
                              else cluster.gpu.name, f"one micro-batch per step on a bf16 GPU for {s.name}",
                              f"master {s.master.format} runs on DeepSpeed's bf16 master mode, which accumulates "
                              "gradients in bf16; pick a strategy with an fp32 master")
    precision = {"bf16": {"enabled": True}} if cluster.gpu.bf16 else {
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                 "hysteresis": 2, "min_loss_scale": 1}}
    if s.master.format != "fp32":
        precision["bf16"]["bf16_master_weights_and_grads"] = True
    cfg: dict[str, Any] = {
        "train_batch_size": t.micro_batch * t.grad_accum * cluster.world,
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": optimizer.gradient_clipping,
        **precision,
        "optimizer": {"type": "AdamW", "params": {"lr": optimizer.lr, "betas": list(optimizer.betas),
                                                  "eps": optimizer.eps, "weight_decay": optimizer.weight_decay}},
        "zero_optimization": zero,
        "steps_per_print": 10,
        "wall_clock_breakdown": False,
    }
    if uses_ds_nvme:
        cfg["aio"] = {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                      "overlap_events": True}
    block = fp4offload_block(s, nvme_path)
    if block.optimizer_states is not None:
        cfg["zero_force_ds_cpu_optimizer"] = False
        cfg["zero_allow_untested_optimizer"] = True
    cfg["fp4offload"] = block.to_dict()
    validate_deepspeed_config(cfg, world_size=cluster.world)
    return cfg


def fsdp_policy(strategy: Strategy, model: ModelSpec, nvme_path: str | None = None) -> FsdpPolicyConfig:
    """The FSDP2 policy for ``strategy`` (engine fsdp2)."""
    s = strategy
    if s.engine != "fsdp2":
        raise ConfigError("--emit", "fsdp", f"an FSDP2 strategy ({s.name} runs on {s.engine})",
                          "use --emit deepspeed for DeepSpeed strategies, or pick one with --strategy")
    block = fp4offload_block(s, nvme_path)
    return FsdpPolicyConfig(weights=block.weights, optimizer_states=block.optimizer_states,
                            activations=block.activations, monitor=block.monitor, cpu_offload=s.fsdp_cpu_offload,
                            reshard_after_forward=s.fsdp_reshard,
                            block_classes=(model.block_class,) if model.block_class else ())


def write_deepspeed(path: str | Path, cfg: dict[str, Any], key: str = "--emit") -> None:
    """Validate and write a DeepSpeed config as JSON (strict JSON: a NaN or an Infinity anywhere is refused, as
    ConfigError naming ``key``, since it is not JSON and DeepSpeed's reader would take it). Written atomically
    through ``jsonfile.write_text`` (random temporary name, 0600, renamed into place)."""
    validate_deepspeed_config(cfg)
    try:
        text = json.dumps(cfg, indent=2, allow_nan=False) + "\n"
    except ValueError as exc:
        bad = next((k for k, v in _walk(cfg) if isinstance(v, float) and not math.isfinite(v)), "?")
        raise ConfigError(bad, "non-finite", "a finite number", f"{key} {path}: {exc}; nothing was written") from None
    write_text(path, text, key)


def write_fsdp(path: str | Path, policy: FsdpPolicyConfig, header: str = "", key: str = "--emit") -> None:
    """Write an FSDP2 policy as YAML (atomically, as :func:`write_deepspeed`)."""
    text = dump_fsdp_policy_yaml(policy, header=header)
    if any(w in (".nan", ".inf", "-.inf") for w in text.replace(":", " ").split()):
        raise ConfigError(key, str(path), "a policy of finite numbers", "nothing was written")
    write_text(path, text, key)


def _walk(x: Any, prefix: str = ""):
    """(key path, value) of every leaf of a JSON-like document."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _walk(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _walk(v, f"{prefix}[{i}]")
    else:
        yield prefix, x
