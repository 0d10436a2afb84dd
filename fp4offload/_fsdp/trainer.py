"""Hugging Face ``Trainer`` on a model sharded by ``fp4offload.fsdp.apply``: :class:`FP4FSDPTrainer`.

::

    from fp4offload.fsdp import FP4FSDPTrainer

    trainer = FP4FSDPTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                             fsdp_policy="configs/fsdp_fp4.yaml")    # or an ff.Policy
    trainer.train()                                # launched with torchrun --nproc_per_node N
    trainer.save_model("final")                    # a from_pretrained folder (gathered on rank 0)

Why a subclass, and what it changes (read in transformers 5.25's ``Trainer`` and Accelerate 1.16):

- The Trainer shards a model only through Accelerate's FSDP plugin (``--fsdp`` or an ``accelerate launch``
  FSDP config). That path cannot carry fp4offload's shards: Accelerate's FSDP2 ``prepare`` maps the optimizer's
  parameters to the model's by ``data_ptr`` and fails on the NVFP4 shards (see fp4offload/_fsdp/accelerate.py),
  and its checkpoint code does the same; on a CPU-only machine Accelerate never turns FSDP on at all. So the
  Trainer runs as plain data parallel (torchrun; ``MULTI_GPU`` / ``MULTI_CPU`` in Accelerate), and this class
  shards the model with :func:`~fp4offload._fsdp.apply.apply` in ``__init__``, before the Trainer sees it.
- Data parallel means the Trainer would wrap the model in DDP, which Accelerate refuses for DTensor parameters
  and which FSDP2 makes redundant (its reduce-scatter averages the gradients). ``_wrap_model`` therefore
  prepares the model as the Trainer does for a model sharded at load time: ``prepare_model(...,
  evaluation_mode=True)`` (autocast for ``--bf16``, no DDP), marked prepared so the Trainer's
  ``accelerator.prepare(model, optimizer)`` registers it without wrapping it again. ``_move_model_to_device`` is
  skipped: ``apply`` put the shards on their device.
- ``create_optimizer`` builds :func:`~fp4offload._fsdp.optim.optimizer` (FP4AdamW over the local shards, or
  torch AdamW when the policy's ``optimizer_states`` is off) from ``learning_rate``, ``adam_beta1/2``,
  ``adam_epsilon`` and ``weight_decay``, with the Trainer's two groups (no decay on biases and norms). LR
  schedulers, ``max_grad_norm`` (Accelerate clips DTensor gradients mesh-aware), gradient accumulation (FSDP2
  reduce-scatters every micro-batch and accumulates the sharded gradients), logging and evaluation are the
  Trainer's own code.
- Checkpoints (``save_steps``): the Trainer's ``torch.save(optimizer.state_dict())`` on rank 0 would hold rank 0's
  shards only, so a checkpoint folder holds ``fp4offload_fsdp/`` written by :func:`fp4offload.fsdp.save` (model
  and optimizer, every rank its own shards, safetensors) beside the Trainer's ``scheduler.pt``, RNG states and
  ``trainer_state.json``. ``train(resume_from_checkpoint=...)`` reads it back with :func:`fp4offload.fsdp.load`
  and repeats the uninterrupted run's losses. ``save_model()`` outside checkpoints gathers the full fp32 weights
  (the masters, not the NVFP4 copies) and writes a ``from_pretrained`` folder from rank 0; every rank must call it.
- After a forward without backward (``evaluate``) FSDP2's root unit keeps the gathered weights as its parameters,
  so the shards are restored before the optimizer is built and before saving or loading.

``--bf16`` (Accelerate's autocast, on top of the policy's ``param_dtype``), ``gradient_checkpointing`` and
evaluation work unchanged. Refused with a ConfigError naming the setting, its value and the fix, in ``__init__``
before the model is sharded: no process group (not launched with torchrun), ``--fsdp`` / an Accelerate FSDP
config, ``--deepspeed``, ``--fp16`` (the GradScaler unscales the optimizer's parameters, which are proxies bound
only in ``step``), ``optim`` other than AdamW, ``optim_args``, ``optimizers=`` / ``optimizer_cls_and_kwargs=``,
``model_init``, ``torch_compile``, ``load_best_model_at_end``, ``auto_find_batch_size``, ``parallelism_config``
and an already sharded model; at resume, a folder without ``fp4offload_fsdp/`` or one written with
``save_only_model``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from transformers import Trainer

from ..errors import ConfigError
from .apply import apply
from .checkpoint import load, save
from .optim import local_shards_of, optimizer as build_optimizer
from .policy import Policy, policy_from_yaml

__all__ = ["FP4FSDPTrainer", "CHECKPOINT_DIR"]

#: the sub-folder of a Trainer checkpoint (``checkpoint-N/``) that fp4offload.fsdp.save writes
CHECKPOINT_DIR = "fp4offload_fsdp"
_SCHEDULER = "scheduler.pt"  # transformers' SCHEDULER_NAME
_ADAMW = ("adamw_torch", "adamw_torch_fused")


def _policy(value) -> Policy:
    if value is None:
        return Policy()
    if isinstance(value, Policy):
        return value
    if isinstance(value, (str, Path)):
        return policy_from_yaml(value)
    raise ConfigError("fsdp_policy", type(value).__name__, "an fp4offload.fsdp.Policy, the path of a policy YAML "
                      "file, or None")


def _refuse(args, model, given: dict) -> None:
    """ConfigError for every setting this Trainer cannot honour (nothing has changed yet); ``given``: the Trainer
    arguments passed, by name."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if given.get("model_init") is not None:
        raise ConfigError("model_init", "given", "None", "pass model=: FP4FSDPTrainer shards the model once, in "
                          "__init__ (a new model per train() or per hyperparameter trial is not supported)")
    if model is None:
        raise ConfigError("model", None, "the unsharded model", "FP4FSDPTrainer shards it in __init__")
    if isinstance(model, FSDPModule) or any(isinstance(p, DTensor) for p in model.parameters()):
        raise ConfigError("model", type(model).__name__, "an unsharded model",
                          "pass the model before fully_shard / fp4offload.fsdp.apply: FP4FSDPTrainer shards it")
    for key in ("optimizers", "optimizer_cls_and_kwargs"):
        if given.get(key) not in (None, (None, None)):
            raise ConfigError(key, "given", "not given", "the optimizer is built over the local shards from the "
                              "policy's optimizer_states; set its hyperparameters with learning_rate, adam_beta1, "
                              "adam_beta2, adam_epsilon and weight_decay")
    checks = [  # (setting, its value, refused when, allowed, fix)
        ("fsdp", args.fsdp, bool(args.fsdp), "'' (off)", "FP4FSDPTrainer shards the model with fsdp_policy; drop "
         "--fsdp and --fsdp_config"),
        ("deepspeed", args.deepspeed, bool(args.deepspeed), "None", "fp4offload's DeepSpeed path is the "
         "\"fp4offload\" block in the DeepSpeed config with the plain Trainer; FP4FSDPTrainer is FSDP2 only"),
        ("fp16", args.fp16, args.fp16, "False", "the fp16 GradScaler would unscale the optimizer's shard proxies, "
         "not the gradients; use --bf16, or the policy's param_dtype"),
        ("torch_compile", args.torch_compile, args.torch_compile, "False", "torch.compile is not supported with "
         "fp4offload's sharded model yet"),
        ("load_best_model_at_end", args.load_best_model_at_end, args.load_best_model_at_end, "False", "load a "
         "checkpoint's fp4offload_fsdp folder with fp4offload.fsdp.load(path, trainer.model) instead"),
        ("auto_find_batch_size", args.auto_find_batch_size, args.auto_find_batch_size, "False", "set "
         "per_device_train_batch_size yourself; a retry would re-create the optimizer over a sharded model"),
        ("parallelism_config", args.parallelism_config, args.parallelism_config is not None, "None",
         "FP4FSDPTrainer shards over one data-parallel dimension (all ranks); for HSDP meshes call "
         "fp4offload.fsdp.apply(model, policy, mesh=...) in your own loop; TP and CP are not supported"),
        ("optim_args", args.optim_args, bool(args.optim_args), "None", "the optimizer's options come from the "
         "policy's optimizer_states"),
    ]
    for key, value, refused, allowed, fix in checks:
        if refused:
            raise ConfigError(f"TrainingArguments.{key}", value, allowed, fix)
    optim = getattr(args.optim, "value", args.optim)
    if optim not in _ADAMW:
        raise ConfigError("TrainingArguments.optim", optim, " or ".join(_ADAMW),
                          "the optimizer is FP4AdamW (or torch AdamW) from the policy's optimizer_states")
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        raise ConfigError("ACCELERATE_USE_FSDP", "true", "unset", "launch with torchrun, or accelerate launch without "
                          "an FSDP config: FP4FSDPTrainer shards the model itself (for Accelerate's FSDP2 in your own "
                          "loop, use fp4offload.fsdp.prepare)")


class FP4FSDPTrainer(Trainer):
    """``transformers.Trainer`` over a model that ``fp4offload.fsdp.apply`` shards with FSDP2, trained by the policy's
    optimizer (FP4AdamW by default). See the module docstring for what it changes and what it refuses.

    Args:
        model: the unsharded model (weights materialized on every rank, on the CPU or the rank's device).
        args: ``TrainingArguments``; launch with ``torchrun --nproc_per_node N`` (a process group must exist).
        fsdp_policy: an :class:`~fp4offload.fsdp.Policy`, the path of a policy YAML file, or None (``Policy()``:
            NVFP4 optimizer states, bf16 compute, the model's ``_no_split_modules`` as blocks).
        *rest, **kwargs: as for ``Trainer`` (``train_dataset``, ``data_collator``, ``callbacks``, ...).

    Attributes:
        fsdp_policy: the policy ``apply`` ran. fp4_optimizer: the optimizer over the shards (inside Accelerate's
            wrapper, ``trainer.optimizer``), once ``train()`` has built it.
    """

    def __init__(self, model: nn.Module | None = None, args=None, *rest: Any, fsdp_policy=None, **kwargs: Any):
        import inspect

        from transformers import TrainingArguments

        if args is None:
            args = TrainingArguments(output_dir="tmp_trainer")
        given = inspect.signature(Trainer.__init__).bind(self, model, args, *rest, **kwargs).arguments
        _refuse(args, model, given)
        policy = _policy(fsdp_policy)
        _ = args.device  # initializes torch.distributed under torchrun (Accelerate's PartialState)
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("torch.distributed", "not initialized", "a process group",
                              "launch with torchrun --nproc_per_node N (also N=1), or accelerate launch without an "
                              "FSDP config")
        # ---- from here on the model changes and collectives run ----
        self.fsdp_policy = policy
        self._fp4_checkpointing = False
        super().__init__(apply(model, policy), args, *rest, **kwargs)
        if self.is_fsdp_enabled or self.is_deepspeed_enabled:  # an Accelerate config the checks above missed
            raise ConfigError("accelerator.distributed_type", str(self.accelerator.distributed_type),
                              "MULTI_GPU, MULTI_CPU or NO", "launch with torchrun: FP4FSDPTrainer shards the model "
                              "itself")

    # ---- the model: sharded already, never wrapped again

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        pass  # apply put every shard on the mesh's device

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader=None) -> nn.Module:
        if not getattr(model, "_is_accelerate_prepared", False):
            model = self.accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
            model._is_accelerate_prepared = True  # Accelerate's own guard: prepare() will not wrap it in DDP
        return model

    # ---- the optimizer

    def _reshard(self) -> None:
        """Back to the sharded parameters: after a forward without backward (evaluate) the root unit holds the
        gathered weights as its parameters, and the optimizer and checkpoints need the shards."""
        from torch.distributed.fsdp import FSDPModule

        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            model = self.model
            self._reshard()
            decay = set(self.get_decay_parameter_names(model))
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            groups = [{"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                      {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
            a = self.args
            self.optimizer = build_optimizer(model, self.fsdp_policy, params=[g for g in groups if g["params"]],
                                             lr=a.learning_rate, betas=(a.adam_beta1, a.adam_beta2),
                                             eps=a.adam_epsilon, weight_decay=a.weight_decay)
        return self.optimizer

    @property
    def fp4_optimizer(self) -> torch.optim.Optimizer | None:
        return local_shards_of(self.optimizer) or self.optimizer  # inside Accelerate's AcceleratedOptimizer

    # ---- saving: fp4offload.fsdp.save inside checkpoints, a gathered from_pretrained folder otherwise

    def _save_checkpoint(self, model, trial) -> None:
        self._fp4_checkpointing = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._fp4_checkpointing = False

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        self._reshard()
        if self._fp4_checkpointing:  # every rank writes its shards; the optimizer too unless save_only_model
            opt = None if self.args.save_only_model else self.fp4_optimizer
            save(os.path.join(output_dir, CHECKPOINT_DIR), self.model, opt)
            return
        if state_dict is None:
            state_dict = self._full_state_dict()
        super()._save(output_dir, state_dict=state_dict)

    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's full fp32 state dict on the CPU of the rank that saves (a collective: every rank gathers)."""
        from torch.distributed.tensor import DTensor

        from .apply import state_dict as sharded_state_dict

        keep = self.args.should_save
        out = {}
        for k, v in sharded_state_dict(self.model).items():
            full = v.full_tensor() if isinstance(v, DTensor) else v
            if keep:
                out[k] = full.detach().cpu()
        return out

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # the optimizer went into fp4offload_fsdp/ with the model (see _save)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER))

    # ---- resuming

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Only checks the folder here (before training starts); model and optimizer are read together once the
        optimizer exists, in :meth:`_load_optimizer_and_scheduler`."""
        folder = os.path.join(resume_from_checkpoint, CHECKPOINT_DIR)
        if not os.path.isdir(folder):
            raise ConfigError("resume_from_checkpoint", str(resume_from_checkpoint),
                              f"a checkpoint folder written by FP4FSDPTrainer (with {CHECKPOINT_DIR}/ in it)",
                              "checkpoints of other Trainers hold unsharded weights: load them into the model before "
                              "passing it to FP4FSDPTrainer, and train without resume_from_checkpoint")
        if not os.path.isfile(os.path.join(resume_from_checkpoint, _SCHEDULER)):
            raise ConfigError("resume_from_checkpoint", str(resume_from_checkpoint),
                              "a checkpoint with the optimizer and scheduler states",
                              "it was written with save_only_model=True; load its weights with "
                              f"fp4offload.fsdp.load('{folder}', trainer.model) and train without "
                              "resume_from_checkpoint")

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        self._load_from_checkpoint(checkpoint)
        self._reshard()
        load(os.path.join(checkpoint, CHECKPOINT_DIR), self.model, self.fp4_optimizer)
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, _SCHEDULER), weights_only=True))
