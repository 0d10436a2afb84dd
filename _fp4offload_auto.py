"""fp4offload's start-up hook: a DeepSpeed program whose config carries the ``"fp4offload"`` block gets it.

``fp4offload-auto.pth``, installed beside this module in site-packages, imports it when the interpreter
starts. It imports nothing but ``sys`` and ``os`` and puts one finder in front of ``sys.meta_path`` that
answers only for ``deepspeed``: when deepspeed is first imported (by the user's script, Accelerate or the
Hugging Face Trainer, under any launcher), the finder lets the real import run and then replaces
``deepspeed.initialize`` with a wrapper of :func:`_initialize`, and leaves ``sys.meta_path``. ``_initialize`` imports
``fp4offload.integrations.deepspeed`` on its first call and hands every call to its ``initialize``, which
passes configs without the block to DeepSpeed untouched.

A program that never imports deepspeed pays one string comparison per import and imports nothing of torch,
deepspeed or fp4offload. ``FP4OFFLOAD_AUTO=0`` (or off/false/no) leaves everything as it is.
See docs/design.md section 5 (DeepSpeed, zero-code entry).
"""

import os
import sys

ENV = "FP4OFFLOAD_AUTO"
OFF = ("0", "off", "false", "no")
MARK = "_fp4offload_hook"  # set on the wrapper; fp4offload.integrations.deepspeed unwraps through it

#: what happened, for ``fp4offload doctor``: "disabled", "waiting" (deepspeed not imported yet), "patched"
state = "disabled"


def _initialize(*args, **kwargs):
    """``deepspeed.initialize`` through fp4offload (installed in its place by the finder)."""
    from fp4offload.integrations import deepspeed as fds

    return fds.initialize(*args, **kwargs)


def _patch(module) -> None:
    global state
    original = getattr(module, "initialize", None)
    if original is None or getattr(original, MARK, False):
        return

    def initialize(*args, **kwargs):
        return _initialize(*args, **kwargs)

    initialize.__wrapped__ = original
    initialize.__doc__ = original.__doc__
    initialize.__name__ = "initialize"
    setattr(initialize, MARK, True)
    module.initialize = initialize
    state = "patched"


class _Loader:
    """The real loader of deepspeed, and the patch once its module has run."""

    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        _patch(module)
        _remove()

    def __getattr__(self, name):  # resource readers, get_source, is_package ... of the real loader
        return getattr(self._inner, name)


class _Finder:
    """Answers only for ``deepspeed``, with the spec the other finders give and its loader wrapped.

    It stays in ``sys.meta_path`` until deepspeed's module has run: ``importlib.util.find_spec("deepspeed")``
    (how Accelerate and transformers ask whether deepspeed is installed) calls it without importing."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != "deepspeed":
            return None
        for finder in sys.meta_path:
            if finder is cls:
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None

    @classmethod
    def invalidate_caches(cls):
        return None


def _remove() -> None:
    global state
    while _Finder in sys.meta_path:
        sys.meta_path.remove(_Finder)
    if state == "waiting":  # deepspeed ran but had no initialize to wrap
        state = "imported"


def enable() -> None:
    """Put the finder in place (or patch an already imported deepspeed). Done at start-up unless disabled."""
    global state
    if os.environ.get(ENV, "1").strip().lower() in OFF:
        state = "disabled"
        return
    ds = sys.modules.get("deepspeed")
    if ds is not None:
        _patch(ds)
        return
    if _Finder not in sys.meta_path:
        sys.meta_path.insert(0, _Finder)
    state = "waiting"


enable()
