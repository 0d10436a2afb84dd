"""fp4offload's start-up hook: a DeepSpeed program whose config carries the ``"fp4offload"`` block gets it.

``fp4offload-auto.pth``, installed at the top of site-packages, runs one line at interpreter start: unless
``FP4OFFLOAD_AUTO`` is an off word (0, false, no, off, none: ``fp4offload._switches.OFF_WORDS``, spelled out in
the line, which can import nothing), it puts a finder first in ``sys.meta_path`` that answers ``None`` for
every name but ``deepspeed`` and, for ``deepspeed``, imports this module and calls :func:`find_spec`. So a
program that never imports deepspeed pays one string comparison per import and imports nothing (not even
this module); the line is one line because ``site`` executes ``.pth`` lines one at a time.

:func:`find_spec` returns the spec the other finders give for deepspeed with its loader wrapped: right
after deepspeed's ``__init__`` has run, ``deepspeed.initialize`` is replaced by a wrapper (marked
``_fp4offload_hook``, the original in ``__wrapped__``) that hands every call to
``fp4offload._deepspeed.engine.initialize`` (imported on the first call; configs without the block
pass through untouched), and the finder leaves ``sys.meta_path``. It stays until then because
``importlib.util.find_spec("deepspeed")`` (how Accelerate and transformers probe) asks it without importing.
Each call of the wrapper first reads ``FP4OFFLOAD_AUTO`` with :mod:`fp4offload._switches`: an off word set since
start-up hands the call to deepspeed's own initialize, and a word that is neither on nor off is a ConfigError
naming the variable. See docs/design.md section 5 (DeepSpeed, zero-code entry).
"""

import sys

MARK = "_fp4offload_hook"  # set on the wrapper; fp4offload._deepspeed.engine unwraps through it
PTH = "fp4offload-auto.pth"

#: "waiting" until deepspeed's module has run, then "patched" (or "imported" when it had no initialize)
state = "waiting"


def _ours(finder) -> bool:
    return bool(getattr(finder, "fp4offload_auto", False))


def _remove() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not _ours(f)]


def _patch(module) -> None:
    global state
    original = getattr(module, "initialize", None)
    if original is None or getattr(original, MARK, False):
        state = "patched" if original is not None else "imported"
        return

    def initialize(*args, **kwargs):
        from fp4offload import _switches as switches

        if not switches.get("FP4OFFLOAD_AUTO"):
            return initialize.__wrapped__(*args, **kwargs)
        from fp4offload._deepspeed import engine as fds

        return fds.initialize(*args, **kwargs)

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


def find_spec(name, path=None, target=None):
    """deepspeed's spec from the finders after ours, with its loader wrapped (None for any other name)."""
    if name != "deepspeed":
        return None
    for finder in list(sys.meta_path):
        find = getattr(finder, "find_spec", None)
        if _ours(finder) or find is None:
            continue
        spec = find(name, path, target)
        if spec is not None:
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _Loader(spec.loader)
            return spec
    return None


def waiting() -> bool:
    """True while the start-up finder is in ``sys.meta_path`` (deepspeed not imported yet)."""
    return any(_ours(f) for f in sys.meta_path)
