"""Saved tensors classed by the op that saves them, for ops whose backward recombines saved inputs with a
saved statistic.

Fused attention (torch's ``scaled_dot_product_attention`` on every backend, flash-attn's ops) keeps the
forward's exact log-sum-exp and, in backward, recomputes the probabilities from the saved query and key:
``P' = exp(q'k'^T * scale - LSE)``. With a 4-bit q' and k' the logits move by whole units, P' is no longer
normalized and the error grows exponentially (one step of SmolLM2-135M: the median parameter's gradient off
by 100x to 20,000x with NVFP4, benchmarks/RESULTS.md "Activations"). Norm layers do the same with their
saved mean and rstd. The rule, written once here for every such op:

- a **statistic** (a float tensor the op saves that has no autograd history and is not one of its inputs:
  log-sum-exp, mean, rstd) is kept exactly, whatever its size;
- the **inputs the backward recombines with it** get a gentle form of their own (``role`` below);
- what else the op saves gets the op class's form.

:class:`OpClasses` is a ``TorchFunctionMode`` that, while a registered op runs, tells the pack hook which op
is saving (:func:`classify`). A custom ``autograd.Function`` (flash-attn's) saves only after its forward
returned; the tensors its inner op (registered with ``after``) took and gave are remembered until the next
registered op, and a tensor packed later is recognized by identity. Nothing is matched by module name, so any
model is covered.
"""

from __future__ import annotations

import functools
import threading
import weakref
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["OpRule", "RULES", "classify", "scope", "rule_for", "register_op"]


@dataclass(frozen=True)
class OpRule:
    """How the tensors one op saves are classed.

    Attributes:
        cls: the class of what it saves (``"attention"``, ``"norm"`` or ``"mlp"``): the policy's format for that
            class.
        roles: argument position -> class of that input (``"attention_qk"`` for the query and key whose
            product backward exponentiates against the saved log-sum-exp).
    """

    cls: str
    roles: tuple[tuple[int, str], ...] = ()
    after: bool = False  # called inside a custom autograd.Function that saves once its forward returned


_QK = ((0, "attention_qk"), (1, "attention_qk"))
_ATTENTION = OpRule("attention", _QK)
_ATTENTION_AFTER = OpRule("attention", _QK, after=True)
_NORM = OpRule("norm")
_MLP = OpRule("mlp")

#: op name -> rule. Names are what ``__name__`` of a torch function, or the qualified name of a custom op
#: (``torch.ops.ns.name``), reads.
RULES: dict[str, OpRule] = {
    # torch's fused attention, every backend (math, flash, memory-efficient, cuDNN; CPU and CUDA); Hugging
    # Face's "sdpa" attention calls it
    "scaled_dot_product_attention": _ATTENTION,
    **{f"aten::{n}": _ATTENTION for n in ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                                          "_scaled_dot_product_flash_attention_for_cpu",
                                          "_scaled_dot_product_efficient_attention",
                                          "_scaled_dot_product_cudnn_attention")},
    "multi_head_attention_forward": OpRule("attention"),  # nn.MultiheadAttention: projections and all
    # flash-attn 2's ops (Hugging Face's "flash_attention_2"), called inside its autograd.Function
    "flash_attn::_flash_attn_forward": _ATTENTION_AFTER,
    "flash_attn::_flash_attn_varlen_forward": _ATTENTION_AFTER,
    # norms with a saved mean / rstd; module-level norms (LlamaRMSNorm written in Python) are found by class name
    "layer_norm": _NORM, "rms_norm": _NORM, "group_norm": _NORM, "batch_norm": _NORM, "instance_norm": _NORM,
    # the MLP's inner tensors: what an activation function saves (its input, or its output for relu, sigmoid,
    # tanh) and the operands of an elementwise product of two activations (SwiGLU's silu(gate) * up); a product
    # with a constant or a tensor without history keeps that operand exactly, as a statistic
    **{n: _MLP for n in ("silu", "gelu", "relu", "leaky_relu", "elu", "selu", "celu", "mish", "softplus",
                         "hardswish", "sigmoid", "tanh", "glu", "mul", "__mul__", "__rmul__")},
}


def register_op(name: str, cls: str = "attention", qk: tuple[int, ...] = (0, 1)) -> None:
    """Class the tensors op `name` saves (a torch function's ``__name__`` or a custom op's ``ns::name``), for
    a fused attention kernel of your own: `qk` are the positions of the arguments backward recombines with
    the saved statistic (stored in ``attention_qk_format``)."""
    if cls not in ("attention", "norm"):
        from ..errors import ConfigError

        raise ConfigError("register_op.cls", cls, "'attention' or 'norm'")
    RULES[name] = OpRule(cls, tuple((i, "attention_qk") for i in qk), after="::" in name)
    _seen.clear()


def _name(func) -> str:
    qual = getattr(func, "_qualified_op_name", None) or getattr(getattr(func, "_schema", None), "name", None)
    return str(qual) if qual else getattr(func, "__name__", "")


_seen: dict = {}  # func -> its rule or None: one dict lookup per torch call once a function was met


def rule_for(func) -> OpRule | None:
    """The rule of a torch function or op, or None."""
    try:
        return _seen[func]
    except KeyError:
        r = _seen[func] = RULES.get(_name(func))
        return r
    except TypeError:  # unhashable callable
        return RULES.get(_name(func))


@functools.lru_cache(maxsize=None)
def _roles(rule: OpRule) -> dict[int, str]:
    """`rule.roles` as a mapping, built once per rule (a saved tensor asks for its role on every save)."""
    return dict(rule.roles)


_KW_POSITION = {"query": 0, "q": 0, "key": 1, "k": 1, "value": 2, "v": 2}  # q, k, v passed by keyword


class _Call:
    __slots__ = ("rule", "args", "results")

    def __init__(self, rule: OpRule, args, kwargs):
        self.rule = rule
        self.args = [(i, weakref.ref(a)) for i, a in enumerate(args) if type(a) is torch.Tensor]
        self.args += [(_KW_POSITION.get(k, -1), weakref.ref(a)) for k, a in kwargs.items() if type(a) is torch.Tensor]
        self.results: list = []

    def role(self, t: torch.Tensor, inside: bool) -> str:
        for i, r in self.args:
            if r() is t:
                return _roles(self.rule).get(i, self.rule.cls if t.requires_grad else "statistic")
        if not inside and not any(r() is t for r in self.results):
            return ""
        if t.is_floating_point() and not t.requires_grad:
            return "statistic"  # made by the op, no autograd history: log-sum-exp, mean, rstd
        return self.rule.cls


class _State(threading.local):
    def __init__(self):
        self.depth = 0
        self.mode: OpClasses | None = None
        self.running: list[_Call] = []
        self.last: _Call | None = None


_state = _State()


class OpClasses(TorchFunctionMode):
    """Marks the registered ops while they run (see the module docstring); every other call passes through."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rule = rule_for(func)
        if rule is None:
            return func(*args, **kwargs)
        call = _Call(rule, args, kwargs)
        _state.running.append(call)
        try:
            out = func(*args, **kwargs)
        finally:
            _state.running.pop()
        res = out if isinstance(out, (tuple, list)) else (out,)
        if rule.after:  # its Function saves next: remember what the op took and gave until another rule runs
            call.results = [weakref.ref(r) for r in res if type(r) is torch.Tensor]
            _state.last = call
        else:
            _state.last = None
        return out


def classify(t: torch.Tensor) -> str | None:
    """The class of a tensor being packed: ``"attention_qk"``, ``"attention"``, ``"norm"``, ``"mlp"``,
    ``"statistic"``, or None (no registered op is saving it)."""
    if _state.depth == 0:
        return None
    if _state.running:
        return _state.running[-1].role(t, inside=True)
    last = _state.last
    if last is not None:
        return last.role(t, inside=False) or None
    return None


class scope:
    """Context in which :func:`classify` works: the first entry on a thread pushes the mode, the last exit
    pops it. Module hooks enter and leave it in nested order; entering it twice costs a counter."""

    __slots__ = ()

    def __enter__(self):
        st = _state
        if st.depth == 0:
            st.mode = OpClasses()
            st.mode.__enter__()
        st.depth += 1
        return self

    def __exit__(self, *exc):
        st = _state
        st.depth -= 1
        if st.depth == 0:
            mode, st.mode, st.last = st.mode, None, None
            mode.__exit__(*exc)
        return False
