"""Which weights stay bf16: the one ``weights.keep_bf16`` matcher, for DeepSpeed and FSDP2 alike.

A rule is one of:

- a plain string: kept when it is a substring of one of the parameter's qualified names
  (``"embed"``, ``"lm_head"``, ``"norm"``, ``"bias"``; a tied parameter has several names);
- ``"first:N"`` / ``"last:N"``: every parameter inside the first / last N transformer blocks of the model,
  counted in model order over the top-level blocks (blocks not nested in another block).

The blocks are the modules whose class is one of the block classes: FSDP2's ``block_classes`` when given
(names, classes or a predicate), else the model's ``_no_split_modules`` (what Hugging Face models declare),
else the children of the model's longest ``nn.ModuleList`` (``model.layers``, ``transformer.h``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch.nn as nn

__all__ = ["block_predicate", "find_blocks", "top_blocks", "kept_parameters"]


def block_predicate(model: nn.Module, block_classes: Any = ()) -> Callable[[nn.Module], bool] | None:
    """A predicate that tells a block module, from ``block_classes`` (class names, classes, or a callable),
    else the model's ``_no_split_modules``; None when neither names anything."""
    if callable(block_classes) and not isinstance(block_classes, type):
        return block_classes
    given = (block_classes,) if isinstance(block_classes, (str, type)) else tuple(block_classes or ())
    if not given:
        given = tuple(getattr(model, "_no_split_modules", None) or ())
    if not given:
        return None
    names = {c for c in given if isinstance(c, str)}
    classes = tuple(c for c in given if isinstance(c, type))
    return lambda m: type(m).__name__ in names or (bool(classes) and isinstance(m, classes))


def _longest_module_list(model: nn.Module) -> list[tuple[str, nn.Module]]:
    best: tuple[str, nn.ModuleList] | None = None
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) and (best is None or len(m) > len(best[1])):
            best = (name, m)
    if best is None:
        return []
    prefix = best[0] + "." if best[0] else ""
    return [(f"{prefix}{i}", child) for i, child in enumerate(best[1])]


def find_blocks(model: nn.Module, block_classes: Any = ()) -> list[tuple[str, nn.Module]]:
    """Every block module of ``model`` (qualified name, module), in model order."""
    match = block_predicate(model, block_classes)
    if match is None:
        return _longest_module_list(model)
    return [(n, m) for n, m in model.named_modules() if n and m is not model and match(m)]


def top_blocks(blocks: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Blocks not nested inside another block, in model order (what first:N / last:N count)."""
    names = [n for n, _ in blocks]
    return [(n, m) for n, m in blocks if not any(n.startswith(o + ".") for o in names if o != n)]


def kept_parameters(model: nn.Module, rules: Iterable[str], blocks: list[tuple[str, nn.Module]]) -> dict[int, str]:
    """``id(param) -> the rule that keeps it bf16``, for every parameter of ``model`` a rule names.

    An entry that names nothing in this model (a typo such as ``"embd"``, or ``"first:N"`` past the model's
    blocks) is a ConfigError naming the entry and the nearest names, so a weight meant to stay bf16 is never
    packed silently. The defaults (config.KEEP_BF16: ``"bias"`` in a model without biases, ...) are generic and
    may name nothing."""
    from fp4offload._config import KEEP_BF16
    from fp4offload.errors import ConfigError

    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    top = top_blocks(blocks)
    keep: dict[int, str] = {}
    for rule in rules:
        which, _, count = rule.partition(":")
        generic = rule in KEEP_BF16
        if which in ("first", "last") and count.isdigit():
            n = int(count)
            if n > len(top) and not generic:
                raise ConfigError("weights.keep_bf16", rule, f"'{which}:N' with N at most {len(top)}, the blocks of "
                                  "this model", f"its blocks: {_sample([b for b, _ in top])}")
            chosen = top[:n] if which == "first" else (top[len(top) - n:] if n else [])
            for _, m in chosen:
                for p in m.parameters():
                    keep.setdefault(id(p), rule)
        else:
            hit = False
            for pid, fqns in names.items():
                if any(rule in f for f in fqns):
                    keep.setdefault(pid, rule)
                    hit = True
            if not hit and not generic:
                raise ConfigError("weights.keep_bf16", rule, "a substring of a parameter name of this model",
                                  f"nearest names: {_nearest(rule, [f for fqns in names.values() for f in fqns])}")
    return keep


def _nearest(rule: str, fqns: list[str]) -> str:
    import difflib

    parts = sorted({part for f in fqns for part in f.split(".") if not part.isdigit()})
    close = difflib.get_close_matches(rule, parts, n=5, cutoff=0.5) or parts[:5]
    return ", ".join(repr(c) for c in close) or "(the model has no parameters)"


def _sample(names: list[str]) -> str:
    if not names:
        return "none found (name the block classes, or use name substrings)"
    return ", ".join(names[:2] + (["..."] if len(names) > 3 else []) + names[-1:]) if len(names) > 2 else \
        ", ".join(names)
