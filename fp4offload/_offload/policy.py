"""ActivationPolicy: what happens to the tensors autograd saves for backward."""

from __future__ import annotations

from dataclasses import dataclass

from .._config import (ACTIVATION_DEVICES, ACTIVATION_FORMATS, ACTIVATION_GENTLENESS, ACTIVATION_MIN_NUMEL,
                      ACTIVATION_MODULE_FORMATS, ACTIVATION_MODULES, ACTIVATION_NORM_CHOICES, ROUNDINGS)
from .._config.checks import check_class_formats
from ..errors import ConfigError


def _patterns(key: str, value) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    try:
        out = tuple(value)
    except TypeError:
        raise ConfigError(key, value,
                          "a tuple of fnmatch patterns over qualified module names, e.g. ('*.mlp',)") from None
    for p in out:
        if not isinstance(p, str) or not p:
            raise ConfigError(key, value, "non-empty strings, e.g. ('*.mlp', 'model.layers.0.*')")
    return out


@dataclass(frozen=True)
class ActivationPolicy:
    """How activations saved for backward are compressed and where they go.

    Attributes:
        format: ``"nvfp4"`` (default; E2M1 with an E4M3 scale per 16 elements and an fp32 tensor
            scale, 0.5625 B/element), ``"mxfp4"`` (E8M0 scale per 32, 0.53 B/element), ``"mxfp8"``
            (E4M3 with an E8M0 scale per 32, 1.03 B/element, the gentle one), ``"int2"`` (experimental: 2-bit
            codes on -3, -1, 1, 3 times an E4M3 scale per 16 rounded up, 0.3125 B/element, stochastically
            rounded; under the op rules below only the linear layers' inputs take it, docs/design.md 3.11) or
            ``"none"`` (moved as is).
        device: ``"cpu"`` (default; host RAM, pinned when CUDA is present, out of a bounded pool of
            reused slabs), ``"nvme"`` (checksummed files in a private temporary folder under
            `nvme_path`, removed when backward is done or the context fails) or ``"same"``
            (compressed where it is, nothing moves).
        min_numel: tensors with fewer elements are left alone (default 2**16 elements).
        nvme_path: folder for ``device="nvme"`` (required there); a temporary folder is made inside it.
        max_host_bytes: cap on host RAM the pool may hold, in bytes. ``None`` (default): half of the
            RAM available when the pool is created, divided by the node's local ranks (``LOCAL_WORLD_SIZE``,
            as torchrun and the DeepSpeed launcher set it). Past the cap tensors stay on their device,
            compressed, and ``overflow_tensors`` counts them.
        slab_bytes: size of one host slab in bytes (default 32 MiB, a power of two, because the
            caching host allocator rounds every pinned request up to one); bigger tensors get a slab
            of the next power of two of their own, which is reused later.
        prefetch: tensors to bring back ahead of time during backward, in reverse order of saving
            (default 2; 0 turns prefetching off).
        modules: fnmatch patterns over qualified module names (``model.named_modules()``) whose
            forward is offloaded, e.g. ``("*.mlp",)``. Empty (default): everything inside the context.
        exclude: patterns of modules whose saved tensors are left alone even inside an included
            module or a whole-model context, e.g. ``("*.self_attn",)``. Exclusion wins.
        module_formats: ``((pattern, format), ...)`` pairs that give matched modules their own format
            (e.g. ``(("*.self_attn", "mxfp8"),)``); those modules are offloaded too.
        error_sample_every: compute the relative error ||dequant(q(x)) - x|| / ||x|| of every n-th
            compressed tensor for the metrics (default 64; 0 turns sampling off).
        dedup: store a tensor saved by several operations once (default True; three projections
            saving the same input are one tensor, not three).
        io_workers: threads that write and read NVMe files (default 2).
        skip_outputs_of: autograd node names (``type(t.grad_fn).__name__``) whose saved outputs are
            left alone. Default ``("LogSoftmaxBackward0",)``: backward exponentiates log-probabilities,
            so an absolute error of a quantized log-probability becomes a relative error of the
            probability (an NVFP4 copy tripled the gradient error of the final norm in a test model).
        rounding: ``"auto"`` (default: stochastic for nvfp4, mxfp4 and int2, nearest for mxfp8),
            ``"nearest"`` or ``"stochastic"`` (nvfp4, mxfp4 and int2 only). Stochastic rounding is unbiased,
            so the error of what backward multiplies with averages out over steps. With norm layers in
            bf16 both train as well as uncompressed; with the norms compressed too, stochastic held up
            where nearest fell behind, so stochastic is the default for robustness (the training runs
            are in benchmarks/RESULTS.md). It costs little on a GPU, and little on a CPU: the CPU
            kernels' stochastic encode is vectorized like the nearest one (AVX-512, AVX2, NEON, SVE)
            and runs at 0.8-1.0x its speed (benchmarks/codec_rounding.py, RESULTS.md).
        seed: seed of the stochastic rounding bits (the codec's counter-based hash of seed, tensor
            position in the step, element). ``None`` (default): new bits for every offloader, i.e.
            every step (reproducible within a process). An int: the same bits every time, so two runs
            of one step agree bit for bit (tests, comparisons between devices).
        norm_format: how tensors saved inside normalization layers are stored: ``"bf16"``
            (default: fp32 rounded to bf16, so 2x smaller, and moved like the rest; bf16 tensors as
            they are, e.g. the fp32 upcast of a bf16 input is stored exactly), ``"keep"`` (left alone),
            ``"inherit"`` (like the module around them), or a format. A norm's backward combines its
            saved input with its exact statistics (rsqrt of the mean square, a tiny tensor); a 4- or
            8-bit input no longer matches them and the mismatch biases every gradient below: compressed
            everywhere, a small Llama trains worse; with the norms kept, as well as uncompressed
            (benchmarks/accuracy_activations.py, benchmarks/RESULTS.md). Ignored for
            ``format="none"`` (which stays exact).
        norm_classes: fnmatch patterns over module class names that are normalization layers
            (default ``("*Norm*",)``: LayerNorm, RMSNorm, LlamaRMSNorm, GroupNorm, BatchNorm2d, ...).
            Norm ops called directly (``F.layer_norm``, ``F.rms_norm``, ...) are found by the op and get
            ``norm_format`` too.
        attention_qk_format: how the query and key that fused attention saves are stored (default
            ``"bf16"``). Its backward recomputes the probabilities from them against the forward's exact
            log-sum-exp (kept exactly, as every saved statistic is): a 4-bit q and k move the logits by units
            and the error grows exponentially (SmolLM2-135M: the median gradient 100x to 20,000x off with
            NVFP4, 1.2x with MXFP8, 1.0x with bf16). Found by the op (``F.scaled_dot_product_attention`` on
            every backend, flash-attn's ops), not by module name. Choices as ``norm_format``.
        attention_format: the rest of what fused attention saves (value and output; default ``"mxfp8"``).
            A 4-bit output biases the row sums backward subtracts. ``"inherit"`` (both attention keys):
            stored like the module around them, as before 2026-12-05.
        mlp_format: the MLP's inner tensors (default ``"mxfp8"``): what an activation function saves (SiLU's
            and GELU's input) and the operands of an elementwise product of two activations (SwiGLU's
            SiLU(gate) and up). Found by the op (``F.silu``, ``F.gelu``, ..., ``*``), like the attention. Alone in
            NVFP4 they are the largest remaining gradient error once the attention is protected (SmolLM2-135M:
            median 0.15 against 0.075 for the linear layers' inputs); in MXFP8 the default policy's error halves
            (0.175 to 0.085) for 19% more kept bytes. ``"inherit"``: stored like the module (the default
            until this key came, later on 2026-12-05). The tensor a linear layer saves (the down projection's
            input) is a linear input and keeps the module's format.
    """

    format: str = "nvfp4"
    device: str = "cpu"
    min_numel: int = ACTIVATION_MIN_NUMEL
    nvme_path: str | None = None
    max_host_bytes: int | None = None
    slab_bytes: int = 1 << 25
    prefetch: int = 2
    modules: tuple[str, ...] = ACTIVATION_MODULES
    exclude: tuple[str, ...] = ()
    module_formats: tuple[tuple[str, str], ...] = ()
    error_sample_every: int = 64
    dedup: bool = True
    io_workers: int = 2
    skip_outputs_of: tuple[str, ...] = ("LogSoftmaxBackward0",)
    rounding: str = "auto"
    seed: int | None = None
    norm_format: str = "bf16"
    norm_classes: tuple[str, ...] = ("*Norm*",)
    attention_qk_format: str = "bf16"
    attention_format: str = "mxfp8"
    mlp_format: str = "mxfp8"

    def __post_init__(self):
        k = "ActivationPolicy."
        if self.format not in ACTIVATION_FORMATS:
            raise ConfigError(k + "format", self.format, " | ".join(repr(f) for f in ACTIVATION_FORMATS))
        if self.device not in ACTIVATION_DEVICES:
            raise ConfigError(k + "device", self.device, " | ".join(repr(d) for d in ACTIVATION_DEVICES))
        for name in ("min_numel", "prefetch", "error_sample_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "min_numel" else 0):
                raise ConfigError(k + name, v, "an integer >= 1" if name == "min_numel" else "an integer >= 0")
        if isinstance(self.io_workers, bool) or not isinstance(self.io_workers, int) or self.io_workers < 1:
            raise ConfigError(k + "io_workers", self.io_workers, "an integer >= 1")
        sb = self.slab_bytes
        if isinstance(sb, bool) or not isinstance(sb, int) or sb < 4096 or sb & (sb - 1):
            raise ConfigError(k + "slab_bytes", sb, "a power of two >= 4096 (bytes)", "e.g. 1 << 25 for 32 MiB")
        mh = self.max_host_bytes
        if mh is not None and (isinstance(mh, bool) or not isinstance(mh, int) or mh < 0):
            raise ConfigError(k + "max_host_bytes", mh,
                              "None (half the available RAM over the local ranks) or bytes >= 0")
        if self.device == "nvme" and not self.nvme_path:
            raise ConfigError(k + "nvme_path", self.nvme_path, "a folder on a fast local disk when device='nvme'",
                              "e.g. ActivationPolicy(device='nvme', nvme_path='/local_nvme')")
        if self.rounding not in ("auto", *ROUNDINGS):
            raise ConfigError(k + "rounding", self.rounding, " | ".join(repr(r) for r in ("auto", *ROUNDINGS)))
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise ConfigError(k + "seed", self.seed, "None or an integer >= 0")
        if self.rounding == "stochastic" and self.format in ("mxfp8", "none"):
            raise ConfigError(k + "rounding", self.rounding, f"'nearest' for format={self.format!r}",
                              "stochastic rounding exists for nvfp4, mxfp4 and int2")
        if not isinstance(self.dedup, bool):
            raise ConfigError(k + "dedup", self.dedup, "True or False")
        object.__setattr__(self, "modules", _patterns(k + "modules", self.modules))
        object.__setattr__(self, "exclude", _patterns(k + "exclude", self.exclude))
        object.__setattr__(self, "skip_outputs_of", _patterns(k + "skip_outputs_of", self.skip_outputs_of))
        object.__setattr__(self, "norm_classes", _patterns(k + "norm_classes", self.norm_classes))
        if self.norm_format not in ACTIVATION_NORM_CHOICES:
            raise ConfigError(k + "norm_format", self.norm_format, " | ".join(repr(f) for f in ACTIVATION_NORM_CHOICES))
        for name in ("attention_qk_format", "attention_format", "mlp_format"):
            if getattr(self, name) not in ACTIVATION_NORM_CHOICES:
                raise ConfigError(k + name, getattr(self, name), " | ".join(repr(f) for f in ACTIVATION_NORM_CHOICES),
                                  "'inherit' stores them like the module around them")
        if self.norm_format in ("nvfp4", "mxfp4", "mxfp8") and self.format == "none":
            raise ConfigError(k + "norm_format", self.norm_format, "'bf16', 'keep' or 'inherit' with format='none'",
                              "format='none' moves tensors exactly; compressing only the norms is not what it is for")
        mf = []
        for item in self.module_formats or ():
            if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str) and item[0]):
                raise ConfigError(k + "module_formats", self.module_formats, "((pattern, format), ...) pairs",
                                  "e.g. (('*.self_attn', 'mxfp8'),)")
            if item[1] not in ACTIVATION_MODULE_FORMATS:
                raise ConfigError(k + "module_formats", item, f"a format in {ACTIVATION_MODULE_FORMATS}")
            mf.append((item[0], item[1]))
        object.__setattr__(self, "module_formats", tuple(mf))
        check_class_formats(k, self.format, tuple(f for _, f in mf),
                            {n: getattr(self, n) for n in ("attention_qk_format", "attention_format", "mlp_format",
                                                           "norm_format")})

    @classmethod
    def from_config(cls, cfg) -> ActivationPolicy:
        """The policy of an ``activations`` sub-block (fp4offload._config.ActivationsConfig, already validated),
        as the DeepSpeed block and the FSDP2 policies apply it; everything the schema does not name keeps
        this class's defaults."""
        return cls(format=cfg.format, device=cfg.device, nvme_path=cfg.nvme_path, min_numel=max(1, int(cfg.min_numel)),
                   modules=tuple(cfg.modules), exclude=tuple(cfg.exclude), max_host_bytes=cfg.max_host_bytes,
                   attention_qk_format=cfg.attention_qk_format, attention_format=cfg.attention_format,
                   mlp_format=cfg.mlp_format)

    def stochastic(self, fmt: str) -> bool:
        """Whether tensors stored in `fmt` are rounded stochastically under this policy."""
        if fmt not in ("nvfp4", "mxfp4", "int2"):
            return False
        return self.rounding in ("auto", "stochastic")

    @property
    def norm_fmt(self) -> str | None:
        """What norm layers get: a format, ``"keep"``, or None (no special treatment)."""
        if self.format == "none" or self.norm_format == "inherit":
            return None
        return self.norm_format

    def class_format(self, cls: str, fmt: str) -> str:
        """The form of a tensor of op class `cls` (fp4offload._offload.ops) saved where `fmt` applies: a format,
        or ``"keep"``. Never harsher than `fmt`: an op rule only makes storage gentler."""
        if cls == "statistic":
            return "keep"
        want = {"attention_qk": self.attention_qk_format, "attention": self.attention_format,
                "norm": self.norm_format, "mlp": self.mlp_format}.get(cls, "inherit")
        if want == "inherit" or self.format == "none":
            return fmt
        return want if ACTIVATION_GENTLENESS[want] > ACTIVATION_GENTLENESS[fmt] else fmt

    def describe(self) -> str:
        """One line: what is stored in which form, and where."""
        if self.format == "none":
            return f"saved activations moved as they are to {self.device}"
        where = {"cpu": "host RAM", "nvme": f"NVMe files under {self.nvme_path}", "same": "where they are"}[self.device]
        scope = f"modules {', '.join(self.modules)}" if self.modules else "every module"
        if self.exclude:
            scope += f" except {', '.join(self.exclude)}"
        rnd = "stochastic" if self.stochastic(self.format) else "nearest"
        parts = [f"saved activations in {self.format.upper()} ({rnd}) to {where}, {scope}"]
        if self.format == "int2":
            parts[0] += " (experimental: 2-bit linear-layer inputs cost accuracy, benchmarks/RESULTS.md)"
        for label, form in (("attention q/k", self.attention_qk_format), ("attention v/output", self.attention_format),
                            ("MLP products", self.mlp_format), ("norms", self.norm_format)):
            if form != "inherit":
                parts.append(f"{label} {form if form == 'keep' else form.upper().replace('BF16', 'bf16')}")
        return "; ".join(parts) + "; statistics exact"

    @property
    def scoped(self) -> bool:
        """True when the policy names modules, so it needs the model to find them."""
        return bool(self.modules or self.exclude or self.module_formats)
