"""The errors fp4offload raises. Each message names what went wrong and what to do about it."""

from __future__ import annotations


class FP4OffloadError(Exception):
    """Base class of every error fp4offload raises on purpose.

    Each pickles as its message (``__reduce__``), so it crosses process boundaries (a broadcast from rank 0, a
    multiprocessing pool) with its class and its text."""

    def __reduce__(self):
        return (_rebuild, (type(self), str(self), dict(self.__dict__)))


def _rebuild(cls: type, message: str, attrs: dict) -> "FP4OffloadError":
    err = cls.__new__(cls)
    BaseException.__init__(err, message)
    err.__dict__.update(attrs)
    return err


class ConfigError(FP4OffloadError, ValueError):
    """A configuration value or argument is not allowed.

    Carries the key path (``optimizer_states.device``, or an argument name), the offending value,
    and what is allowed, so the message can say how to fix it.
    """

    def __init__(self, key: str, value, allowed: str, hint: str | None = None):
        self.key, self.value, self.allowed = key, value, allowed
        msg = f"{key}={value!r} is not allowed; expected {allowed}"
        if hint:
            msg += f". {hint}"
        super().__init__(msg)


class NonFiniteError(FP4OffloadError, ValueError):
    """A tensor to be quantized holds Inf or NaN and the non-finite mode is ``raise``."""

    def __init__(self, name: str, count: int, numel: int):
        self.name, self.count, self.numel = name, count, numel
        super().__init__(
            f"tensor {name!r} holds {count} non-finite value(s) (Inf/NaN) out of {numel}; "
            "find where they come from, or quantize with nonfinite='propagate' to carry them as NaN blocks"
        )


class CorruptionError(FP4OffloadError, IOError):
    """A file fp4offload wrote does not read back as written (bad header, checksum, size)."""

    def __init__(self, path, what: str, *, offset: int | None = None, expected=None, found=None):
        self.path, self.what, self.offset, self.expected, self.found = path, what, offset, expected, found
        msg = f"{path}: {what}"
        if offset is not None:
            msg += f" at offset {offset}"
        if expected is not None or found is not None:
            msg += f" (expected {expected}, found {found})"
        msg += "; the file is damaged or was written by something else: restore it from a checkpoint"
        super().__init__(msg)


class CapacityError(FP4OffloadError, RuntimeError):
    """Something does not fit: RAM, GPU memory or disk space."""

    def __init__(self, what: str, need: int, have: int, hint: str | None = None):
        self.what, self.need, self.have = what, need, have
        msg = (f"{what} needs {need / 2**20:.1f} MiB but only {have / 2**20:.1f} MiB is available "
               f"(short by {(need - have) / 2**20:.1f} MiB)")
        if hint:
            msg += f"; {hint}"
        super().__init__(msg)
