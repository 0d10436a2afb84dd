"""What the automatic choices share (``"fp4offload": {"auto": true}`` in DeepSpeed, ``Policy.auto()`` in FSDP2): a
candidate, the decision and the line it logs, and deciding on rank 0 for every rank."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from fp4offload.errors import CapacityError, ConfigError

__all__ = ["Candidate", "Decision", "gib", "on_rank_0"]

T = TypeVar("T")


def gib(n: float) -> str:
    return f"{n / float(1 << 30):.2f} GiB"


@dataclass(frozen=True)
class Candidate:
    """One block auto may choose: its name and the block as a user would write it."""

    name: str
    block: dict


@dataclass
class Decision:
    """What auto chose and why. ``estimate``: the choice's host RAM per rank; ``need``: what it adds on this
    node; ``free``: what the node's processes may still take, from ``source``. ``tried``: (candidate name, what
    it would add on the node or None, why it was not taken), in order, the choice last (its reason ``""``)."""

    choice: Candidate | None
    estimate: int = 0
    need: int = 0
    free: int = 0
    source: str = ""
    tried: list[tuple[str, int | None, str]] = field(default_factory=list)
    spare: int = 0  #: what the choice leaves unclaimed beyond its estimate, on this node

    def line(self) -> str:
        """The one line the log gets."""
        rest = [f"{n} ({why})" for n, _, why in self.tried if why]
        head = f"auto: chose {self.choice.name}" if self.choice is not None else "auto: nothing fits"
        spare = f", keeping {self.spare / float(1 << 20):.0f} MiB spare" if self.spare else ""
        return (f"{head}: adds {gib(self.need)} on this node ({gib(self.estimate)} per rank){spare}, may use "
                f"{self.source}" + ("; not taken: " + "; ".join(rest) if rest else ""))


def on_rank_0(choose: Callable[[], T]) -> T:
    """``choose()`` on rank 0, its result (or its ConfigError / CapacityError) broadcast to every rank of the
    default process group; ``choose()`` here when there is no group or one rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return choose()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", choose())
        except (ConfigError, CapacityError) as exc:
            box[0] = ("error", exc)
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise value
    return value
