"""JIT building of the C++/CUDA extensions with torch.utils.cpp_extension, cached in TORCH_EXTENSIONS_DIR."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from .. import _switches as switches


def csrc_dir() -> Path:
    """The csrc/ folder: the top-level one in a source checkout, or the copy shipped in the wheel."""
    here = Path(__file__).resolve().parents[2] / "csrc"
    if (here / "fp4_codec.h").exists():
        return here
    return Path(str(resources.files("fp4offload._csrc")))


def build(name: str, sources: list[str], *, cuda: bool = False, extra_cflags=(), extra_cuda_cflags=(),
          root: Path | None = None):
    """Compile (or load the cached build of) an extension from files under csrc/ (or under `root`, another copy of
    it: benchmarks build an earlier revision's under its own module name)."""
    from torch.utils import cpp_extension

    root = csrc_dir() if root is None else Path(root)
    verbose = switches.get("FP4OFFLOAD_VERBOSE_BUILD")
    # no fast math and no FMA contraction (every operation rounds as the reference's does); errno and FP traps off,
    # which change no value but let the compiler vectorize sqrt and turn selects of FP results into blends
    flags = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", *extra_cflags]
    kwargs = dict(name=name, sources=[str(root / s) for s in sources], extra_include_paths=[str(root)],
                  extra_cflags=flags, verbose=verbose)
    if cuda:
        kwargs["extra_cuda_cflags"] = ["-O3", "--fmad=false", *extra_cuda_cflags]
    return cpp_extension.load(**kwargs)
