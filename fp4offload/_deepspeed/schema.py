"""Validation of a whole DeepSpeed config that may carry the ``"fp4offload"`` block.

:func:`validate_deepspeed_config` checks how the block (:func:`fp4offload._config.block.
parse_block`) combines with DeepSpeed's own keys. Nothing here imports deepspeed unless asked to
(``check_with_deepspeed``), nothing looks at the disk, and nothing imports torch: the planner emits configs
through it. The rewrite at initialize (:mod:`fp4offload._deepspeed.config`) calls it first.
"""

from __future__ import annotations

from typing import Any, Mapping

from fp4offload._config.block import Fp4OffloadConfig, parse_block
from fp4offload.errors import ConfigError

__all__ = ["find_auto_values", "validate_deepspeed_config"]


def find_auto_values(cfg: Any, path: str = "") -> list[str]:
    """Key paths in ``cfg`` whose value is the string ``"auto"`` (DeepSpeed drops those silently)."""
    found: list[str] = []
    if isinstance(cfg, Mapping):
        for k, v in cfg.items():
            found += find_auto_values(v, f"{path}.{k}" if path else str(k))
    elif isinstance(cfg, (list, tuple)):
        for i, v in enumerate(cfg):
            found += find_auto_values(v, f"{path}[{i}]")
    elif isinstance(cfg, str) and cfg.strip().lower() == "auto":
        found.append(path)
    return found


def _get(d: Mapping[str, Any], dotted: str) -> Any:
    cur: Any = d
    for part in dotted.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return None
        cur = cur[part]
    return cur


def _offload_device(ds: Mapping[str, Any], which: str) -> str | None:
    dev = _get(ds, f"zero_optimization.{which}.device")
    return None if dev in (None, "none") else dev


def validate_deepspeed_config(ds: Mapping[str, Any], *, world_size: int | None = None,
                              check_with_deepspeed: bool = False) -> Fp4OffloadConfig:
    """Check a whole DeepSpeed config dict that may carry an ``"fp4offload"`` block.

    The one place that checks how the block combines with DeepSpeed's own keys. Checks: no DeepSpeed
    key holds ``"auto"``; the block itself (``parse_block``); weights need ZeRO-3 with ``offload_param``
    on the same device, and neither ZeRO++'s quantized weights nor hierarchical partitions; packed
    optimizer states need DeepSpeed to accept a client optimizer (``zero_force_ds_cpu_optimizer``
    false, ``zero_allow_untested_optimizer`` true), must not sit behind DeepSpeed's own NVMe
    optimizer swapper, and need ZeRO for an offloaded optimizer or fp16; bf16 and fp16 are not both
    on; the batch sizes agree when ``world_size`` is given. With ``check_with_deepspeed`` the
    ``zero_optimization`` section is also validated by DeepSpeed's own schema (imports deepspeed, slow).
    Returns the parsed block.
    """
    if not isinstance(ds, Mapping):
        raise ConfigError("<deepspeed config>", type(ds).__name__, "a JSON object (dict)")
    own = {k: v for k, v in ds.items() if k != "fp4offload"}
    autos = find_auto_values(own)
    if autos:
        raise ConfigError(autos[0], "auto", "a concrete value",
                          "DeepSpeed drops keys set to \"auto\" without a word (only the HF Trainer fills them); "
                          "write the number, or let `fp4offload plan --emit deepspeed` write the config")
    block = parse_block(ds.get("fp4offload"), prefix="fp4offload.")

    zero = ds.get("zero_optimization") or {}
    if not isinstance(zero, Mapping):
        raise ConfigError("zero_optimization", zero, "a JSON object")
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ConfigError("zero_optimization.stage", stage, "0, 1, 2 or 3")

    if _get(ds, "bf16.enabled") is True and _get(ds, "fp16.enabled") is True:
        raise ConfigError("fp16.enabled", True, "false when bf16.enabled is true", "pick one of bf16 and fp16")

    if block.weights is not None:
        w = block.weights
        if stage != 3:
            raise ConfigError("fp4offload.weights", block.to_dict()["weights"],
                              "only with zero_optimization.stage 3",
                              f"stage is {stage}: set \"stage\": 3 and offload_param, or remove the weights block")
        dev = _offload_device(ds, "offload_param")
        if dev != w.device:
            raise ConfigError("zero_optimization.offload_param.device", dev,
                              f"{w.device!r} (fp4offload.weights.device)",
                              "packed weights live in the host/NVMe partition DeepSpeed fetches from; "
                              f"add \"offload_param\": {{\"device\": \"{w.device}\", \"pin_memory\": true}}")

    if block.optimizer_states is not None:
        if ds.get("zero_force_ds_cpu_optimizer") is not False:
            raise ConfigError("zero_force_ds_cpu_optimizer", ds.get("zero_force_ds_cpu_optimizer"), "false",
                              "fp4offload's optimizer is a client optimizer; DeepSpeed replaces or rejects it unless "
                              "\"zero_force_ds_cpu_optimizer\": false")
        if stage >= 1 and ds.get("zero_allow_untested_optimizer") is not True:
            raise ConfigError("zero_allow_untested_optimizer", ds.get("zero_allow_untested_optimizer"), "true",
                              "ZeRO refuses client optimizers it does not know unless "
                              "\"zero_allow_untested_optimizer\": true")
        if _offload_device(ds, "offload_optimizer") == "nvme":
            raise ConfigError("zero_optimization.offload_optimizer.device", "nvme",
                              "'cpu' or 'none' when fp4offload.optimizer_states is set",
                              "DeepSpeed's NVMe optimizer swapper cannot hold packed states: set offload_optimizer "
                              "to \"cpu\" and fp4offload.optimizer_states.device to \"nvme\" with an nvme_path")
        if _offload_device(ds, "offload_optimizer") == "cpu" and stage == 0:
            raise ConfigError("zero_optimization.stage", 0, "1, 2 or 3 when offload_optimizer is set",
                              "DeepSpeed offloads the optimizer only under ZeRO")
        if _get(ds, "fp16.enabled") and stage == 0:
            raise ConfigError("fp16.enabled", True, "false without ZeRO when fp4offload.optimizer_states is set",
                              "DeepSpeed's fp16 optimizer wrapper flattens states itself; use ZeRO 1-3 or bf16")

    if block.weights is not None and block.weights.format == "nvfp4":
        if zero.get("zero_quantized_weights") or zero.get("zero_quantized_nontrainable_weights"):
            raise ConfigError("zero_optimization.zero_quantized_weights", True, "false with fp4offload.weights",
                              "both replace how partitions are stored and fetched; keep one")
        if zero.get("zero_hpz_partition_size", 1) not in (1, None):
            raise ConfigError("zero_optimization.zero_hpz_partition_size", zero.get("zero_hpz_partition_size"),
                              "1 with fp4offload.weights", "hierarchical partitions keep a second bf16 copy")

    _check_batch(ds, world_size)
    if check_with_deepspeed and zero:
        _check_zero_with_deepspeed(zero)
    return block


def _check_batch(ds: Mapping[str, Any], world_size: int | None) -> None:
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    for k in keys:
        v = ds.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(k, v, "a positive integer")
    tb, mb, ga = (ds.get(k) for k in keys)
    if world_size and None not in (tb, mb, ga) and tb != mb * ga * world_size:
        raise ConfigError("train_batch_size", tb, f"{mb} x {ga} x {world_size} = {mb * ga * world_size}",
                          "train_batch_size must equal micro batch x accumulation steps x data-parallel ranks")


def _check_zero_with_deepspeed(zero: Mapping[str, Any]) -> None:
    try:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig  # slow import, on demand only
    except Exception as exc:  # pragma: no cover - deepspeed is a dependency
        raise ConfigError("zero_optimization", "<not checked>", "a config DeepSpeed accepts",
                          f"deepspeed could not be imported to check it: {exc}") from exc
    try:
        DeepSpeedZeroConfig(**dict(zero))
    except Exception as exc:
        first = str(exc).strip().splitlines()
        raise ConfigError("zero_optimization", "<see hint>", "keys and values DeepSpeed's ZeRO config accepts",
                          " ".join(first[:4])) from None
