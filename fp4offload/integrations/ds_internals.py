"""``fp4offload.integrations.ds_internals`` is :mod:`fp4offload._deepspeed.internals`: importing it by this name
gives that module itself (the same object, the same table and accessors)."""

import sys

from fp4offload._deepspeed import internals as _internals

sys.modules[__name__] = _internals
