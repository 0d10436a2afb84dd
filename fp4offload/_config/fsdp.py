"""The schema of an FSDP2 policy (:class:`FsdpPolicyConfig`) and its YAML file.

The policy takes the block's sub-blocks but ``host`` (:mod:`fp4offload._config.block`) plus ``cpu_offload``,
``reshard_after_forward`` and ``block_classes`` at the top level. :func:`parse_fsdp_policy` reads a mapping,
:func:`load_fsdp_policy_yaml` a file (read with care: a regular UTF-8 file of at most 1 MiB, each key once),
:func:`dump_fsdp_policy_yaml` writes one. Building a policy never looks at the folders it names.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from fp4offload.errors import ConfigError

from .block import (_FSDP_SUBBLOCKS, ActivationsConfig, MonitorConfig, OptimizerStatesConfig, WeightsConfig,
                    _parse_sub, _to_plain, _unknown)
from .checks import _as_tuple, check_bool, _check_names, _error, _kind

__all__ = ["FsdpPolicyConfig", "check_fsdp_states", "parse_fsdp_policy", "load_fsdp_policy_yaml",
           "dump_fsdp_policy_yaml", "POLICY_MAX_BYTES"]


@dataclass(frozen=True)
class FsdpPolicyConfig:
    """An FSDP2 (``fully_shard``) policy with the same sub-blocks as the DeepSpeed block.

    Attributes:
        weights: weight shards all-gathered as NVFP4 (the fp32 shard stays the master; with
            ``cpu_offload`` the host-to-device copy carries the packed bytes too). ``weights.device``
            must be ``"cpu"`` (FSDP2 offloads to host RAM only). Default None (off).
        optimizer_states: packed Adam states, as in the DeepSpeed block. Default ``OptimizerStatesConfig()``
            (NVFP4 states: the one feature on by default, as in ``fp4offload.fsdp.Policy()``; ``null`` turns
            it off). Weights and activations change the forward pass's numbers, so they are opted into.
        activations: saved-tensor packing and offload. Default None.
        monitor: metrics interval. Default None.
        cpu_offload: shard parameters, gradients and optimizer states in host RAM
            (``CPUOffloadPolicy``); the optimizer steps on the CPU. Default False.
        reshard_after_forward: free gathered parameters after forward and gather again in
            backward (ZeRO-3 behaviour) rather than keep them (ZeRO-2). Default True.
        block_classes: class names of the modules to wrap with ``fully_shard`` one by one
            (e.g. ``["LlamaDecoderLayer"]``); the root module is always wrapped. Default [].
        auto: ``apply`` chooses the optimizer's master form and where its states live from the model, the mesh
            and the live readings (``fp4offload.fsdp.Policy.auto()``). Default False.
    """

    weights: WeightsConfig | None = None
    optimizer_states: OptimizerStatesConfig | None = field(default_factory=OptimizerStatesConfig)
    activations: ActivationsConfig | None = None
    monitor: MonitorConfig | None = None
    cpu_offload: bool = False
    reshard_after_forward: bool = True
    block_classes: tuple[str, ...] = field(default=())
    auto: bool = False

    def __post_init__(self) -> None:
        for name, cls in _FSDP_SUBBLOCKS.items():
            v = getattr(self, name)
            if v is not None and not isinstance(v, cls):
                raise _error(name, v, f"a {cls.__name__} or None")
        _as_tuple(self, "block_classes")
        check_bool("cpu_offload", self.cpu_offload)
        check_bool("auto", self.auto)
        check_bool("reshard_after_forward", self.reshard_after_forward)
        _check_names("block_classes", self.block_classes)
        if self.weights is not None and self.weights.device != "cpu":
            raise _error("weights.device", self.weights.device, "'cpu' under FSDP2",
                         "FSDP2 offloads to host RAM only; NVMe weights need DeepSpeed ZeRO-3 offload_param")
        check_fsdp_states(self.optimizer_states, self.cpu_offload)

    def to_dict(self) -> dict[str, Any]:
        """The YAML form (absent sub-blocks left out; no optimizer states written as ``null``, since leaving the
        key out means the default states), as ``parse_fsdp_policy`` reads it back."""
        out: dict[str, Any] = {n: _to_plain(getattr(self, n)) for n in _FSDP_SUBBLOCKS if getattr(self, n) is not None}
        if self.optimizer_states is None:
            out["optimizer_states"] = None
        out.update(cpu_offload=self.cpu_offload, reshard_after_forward=self.reshard_after_forward,
                   block_classes=list(self.block_classes))
        if self.auto:
            out["auto"] = True
        return out


_FSDP_SCALARS = ("cpu_offload", "reshard_after_forward", "block_classes", "auto")


def check_fsdp_states(states: OptimizerStatesConfig | None, cpu_offload: Any = False) -> None:
    """What the FSDP2 optimizer would ignore in ``optimizer_states``: an nvme_path with device 'same' (DeepSpeed
    reads that pair for its NVMe offload; FSDP2 has none, so the states stay beside the shards), and device 'cpu'
    with format 'fp32' without cpu_offload (torch AdamW keeps its states beside the shards, on the GPU)."""
    if states is None:
        return
    if states.nvme_path is not None and states.device != "nvme":
        raise _error("optimizer_states.nvme_path", states.nvme_path, "null unless device is 'nvme'",
                     f"under FSDP2 device {states.device!r} keeps the states beside the shards, so the folder would "
                     "be ignored: remove it, or set device 'nvme'")
    if states.format == "fp32" and states.device == "cpu" and cpu_offload is not True:
        raise _error("optimizer_states.device", "cpu", "'same' with format 'fp32' (or cpu_offload: true)",
                     "format 'fp32' is torch AdamW, whose states stay beside the shards (on the GPU without "
                     "cpu_offload): set cpu_offload true to keep shards and states in host RAM, or format 'nvfp4'")


def parse_fsdp_policy(doc: Mapping[str, Any] | None) -> FsdpPolicyConfig:
    """Validate an FSDP2 policy mapping (from YAML) and return it as a dataclass."""
    if doc is None:
        return FsdpPolicyConfig()
    if not isinstance(doc, Mapping):
        raise _error("<fsdp policy>", doc, "a mapping with optional keys "
                     + ", ".join([*_FSDP_SUBBLOCKS, *_FSDP_SCALARS]))
    allowed = [*_FSDP_SUBBLOCKS, *_FSDP_SCALARS]
    for k in doc:
        if k not in allowed:
            raise _unknown(str(k), doc[k], allowed)
    # a sub-block left out takes its default (optimizer_states on, the rest off); written as null, it is off
    kwargs: dict[str, Any] = {n: _parse_sub(n, c, doc[n]) for n, c in _FSDP_SUBBLOCKS.items() if n in doc}
    for k in _FSDP_SCALARS:
        if k in doc:
            v = doc[k]
            kwargs[k] = tuple(v) if isinstance(v, list) else v
    return FsdpPolicyConfig(**kwargs)


#: the largest policy file read (a policy is a few hundred bytes; anything this large is the wrong file)
POLICY_MAX_BYTES = 1 << 20


def load_fsdp_policy_yaml(path: str | Path) -> FsdpPolicyConfig:
    """Read and validate an FSDP2 policy YAML file.

    The file must be a regular file (a FIFO or a device is not opened: it could block or never end) of at most
    1 MiB, UTF-8, valid YAML, one mapping with no key written twice (YAML would keep the last one without a
    word; the error names the key path and both lines), and not empty: an empty document, or one of comments
    only, is a ConfigError (a truncated or wrong file; write ``{}`` for the defaults, NVFP4 optimizer states only,
    and ``optimizer_states: null`` for a policy with every feature off).
    """
    import yaml

    p = Path(path)
    try:
        st = os.stat(p)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(str(p), f"<{_kind(st.st_mode)}>", "a regular YAML file",
                              "it is not read: it could block or never end")
        if st.st_size > POLICY_MAX_BYTES:
            raise ConfigError(str(p), f"<{st.st_size} bytes>", f"a policy file of at most {POLICY_MAX_BYTES} bytes",
                              "a policy is a few hundred bytes: is this the right file?")
        with open(p, "rb") as f:
            data = f.read(POLICY_MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(str(p), "<unreadable>", "a readable YAML file", str(exc)) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(str(p), "<not UTF-8>", "a UTF-8 YAML file",
                          f"byte {exc.start} ({data[exc.start:exc.start + 1]!r}) is not UTF-8: {exc.reason}") from None
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)(text)  # libyaml when PyYAML has it: the same documents
    try:
        node = loader.get_single_node()  # composed first, so duplicate keys are seen before they are merged
        if node is not None:
            _refuse_duplicate_keys(node, p)
        doc = None if node is None else loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise ConfigError(str(p), "<invalid YAML>", "a YAML mapping", str(exc).splitlines()[0]) from None
    except RecursionError:
        raise ConfigError(str(p), "<invalid YAML>", "a YAML mapping", "it nests too deeply") from None
    finally:
        loader.dispose()
    if node is None or doc is None:
        raise ConfigError(str(p), "<empty document>", "a YAML mapping of the policy's keys",
                          "the file holds no policy (empty, comments only, or null): write {} for one with every "
                          "feature off, or check that this is the right file")
    if not isinstance(doc, Mapping):
        raise ConfigError(str(p), doc, "a YAML mapping with optional keys " + ", ".join([*_FSDP_SUBBLOCKS,
                                                                                          *_FSDP_SCALARS]))
    return parse_fsdp_policy(doc)


def _refuse_duplicate_keys(node: Any, p: Path, path: str = "", seen: set | None = None) -> None:
    """ConfigError for a mapping key written twice anywhere in the composed YAML document (key path, lines)."""
    import yaml

    seen = set() if seen is None else seen
    if id(node) in seen:  # an alias to a node already walked
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict[Any, int] = {}
        for k, v in node.value:
            name = k.value if isinstance(k, yaml.ScalarNode) else None
            key = f"{path}.{name}" if path else str(name)
            if name is not None:
                if name in first and name != "<<":
                    raise ConfigError(key, "<written twice>", "each key once in its mapping",
                                      f"{p} sets it on line {first[name]} and again on line {k.start_mark.line + 1}; "
                                      "YAML would keep the last one without a word: delete one")
                first[name] = k.start_mark.line + 1
            _refuse_duplicate_keys(v, p, key, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _refuse_duplicate_keys(v, p, f"{path}[{i}]", seen)


def dump_fsdp_policy_yaml(policy: FsdpPolicyConfig, path: str | Path | None = None, *, header: str = "") -> str:
    """Write ``policy`` as YAML (to ``path`` if given) and return the text."""
    import yaml

    text = "".join(f"# {line}\n" for line in header.splitlines()) + yaml.safe_dump(policy.to_dict(), sort_keys=False)
    if path is not None:
        Path(path).write_text(text)
    return text
