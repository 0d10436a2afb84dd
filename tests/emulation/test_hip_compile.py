"""The CUDA kernel sources compile for AMD GPUs with hipcc, for gfx90a (MI200), with the flags the ROCm JIT build uses.

Every csrc/cuda/*.cu file (the kernels, torch-free; the bindings csrc/cuda/*.cpp are hipified by torch's own ROCm
build and not compiled here) is compiled with ``hipcc -x hip --offload-arch=gfx90a``, so kernels added later are
checked too. Nothing is copied per platform: csrc/cuda/gpu_compat.h maps the CUDA names, and the kernels use a
64-lane warp (wave64) under HIP, which the device code's metadata shows.

The toolchain is Debian's ``hipcc`` package (HIP 5.2, clang 15): ``apt-get install hipcc``. Without it the tests
skip, naming that line; under CI (``CI`` set, as .ci/run does) they fail instead. HIP 5.2 knows targets up to
gfx90a: gfx942 (MI300) and gfx950 (MI355) are not compiled here, and nothing here has run on AMD hardware.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers.extensions import skip_or_fail
from fp4offload._ops import build, cuda

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
CU_FILES = sorted((CSRC / "cuda").glob("*.cu"))
ARCH = "gfx90a"
HIPCC = shutil.which("hipcc")
HIPCC_FIX = "apt-get install hipcc"


@pytest.fixture(scope="module")
def hipcc():
    if HIPCC is None:
        skip_or_fail(f"hipcc is not on PATH: the HIP build of the CUDA sources is compile-checked only where it is "
                     f"installed ({HIPCC_FIX})")
    return HIPCC


def rocm_jit_flags(monkeypatch, extra=None) -> list[str]:
    """The hipcc flags fp4offload._ops.build passes to torch's JIT builder on a ROCm torch (``torch.version.hip``
    set) for gfx90a, read off the real call; `extra` is the caller's extra_cuda_cflags (default: the codec's)."""
    import torch
    from torch.utils import cpp_extension

    seen = {}
    monkeypatch.setattr(torch.version, "hip", "5.2.21153", raising=False)
    monkeypatch.setenv("PYTORCH_ROCM_ARCH", ARCH)
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: seen.update(kw))
    monkeypatch.setattr(build, "cached", lambda *a: None)  # never a cached library imported instead of calling load
    build.build("fp4offload_cuda", cuda.SOURCES, cuda=True,
                extra_cuda_cflags=cuda.device_flags() if extra is None else extra)
    return list(seen["extra_cuda_cflags"])


def _torch_hip_flags() -> list[str]:
    """What torch adds to every hipcc command of an extension (cpp_extension.COMMON_HIP_FLAGS, COMMON_HIPCC_FLAGS)."""
    from torch.utils import cpp_extension

    return [*getattr(cpp_extension, "COMMON_HIP_FLAGS", []), *getattr(cpp_extension, "COMMON_HIPCC_FLAGS", [])]


def test_rocm_jit_flags_are_hipcc_flags_for_exact_ieee(monkeypatch):
    flags = rocm_jit_flags(monkeypatch)
    assert flags.count("-std=c++17") == 1 and "-O3" in flags
    assert "-ffp-contract=off" in flags and "-fhip-fp32-correctly-rounded-divide-sqrt" in flags
    assert "-mwavefrontsize64" in flags and "-fno-gpu-flush-denormals-to-zero" in flags
    assert [f for f in flags if f.startswith("--offload-arch")] == [f"--offload-arch={ARCH}"]
    assert not any(f.startswith(cuda.NVCC_ONLY_PREFIXES) for f in flags), flags
    assert not any("fast" in f for f in flags if f != "-ffp-contract=off"), flags
    # the fused step's build (fp4offload/_optim/fused.py: -std=c++17 alone) gets the same flags and its targets
    assert rocm_jit_flags(monkeypatch, ["-std=c++17"]) == flags
    # nvcc-only flags a caller passes are left out, targets it names are kept
    named = rocm_jit_flags(monkeypatch, [*cuda.nvcc_flags(["90"]), "--offload-arch=gfx942"])
    assert [f for f in named if f.startswith("--offload-arch")] == ["--offload-arch=gfx942"]
    assert not any(f.startswith(cuda.NVCC_ONLY_PREFIXES) for f in named), named


def test_rocm_targets_come_from_pytorch_rocm_arch(monkeypatch):
    monkeypatch.setenv("PYTORCH_ROCM_ARCH", "gfx90a; gfx942:xnack-")
    assert cuda.rocm_archs() == ["gfx90a", "gfx942:xnack-"]
    assert cuda.hipcc_flags()[-2:] == ["--offload-arch=gfx90a", "--offload-arch=gfx942:xnack-"]
    monkeypatch.setenv("PYTORCH_ROCM_ARCH", "sm_90")
    with pytest.raises(ValueError, match=r"PYTORCH_ROCM_ARCH='sm_90': 'sm_90' is not an AMD GPU target"):
        cuda.rocm_archs()
    monkeypatch.delenv("PYTORCH_ROCM_ARCH")
    monkeypatch.setattr(cuda.torch.cuda, "device_count", lambda: 0)
    with pytest.raises(RuntimeError, match="set PYTORCH_ROCM_ARCH"):
        cuda.hipcc_flags()
    # a CUDA torch keeps the nvcc command line
    monkeypatch.setattr(cuda.torch.version, "hip", None, raising=False)
    assert not cuda.is_rocm() and cuda.device_flags(["90"]) == cuda.nvcc_flags(["90"])
    assert build.device_cflags(["-std=c++17"]) == ["-O3", "--fmad=false", "-std=c++17"]


@pytest.fixture(scope="module")
def compiled(hipcc, tmp_path_factory):
    """src -> (object file, hipcc stderr, the gfx90a assembly), each compiled once (a few seconds each)."""
    out_dir = tmp_path_factory.mktemp("hipcc")
    with pytest.MonkeyPatch.context() as mp:
        flags = rocm_jit_flags(mp)
    cache: dict = {}

    def get(src: Path):
        if src not in cache:
            work = out_dir / src.stem
            work.mkdir()
            obj = work / f"{src.stem}.o"
            # -save-temps keeps the device assembly; HIP_PLATFORM=amd, as hipcc picks nvcc when it finds one
            cmd = [hipcc, "-x", "hip", *flags, *_torch_hip_flags(), "-Wall", "-I", str(CSRC), "-save-temps", "-c",
                   str(src), "-o", str(obj)]
            env = dict(os.environ, HIP_PLATFORM="amd")
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=work, env=env)
            assert proc.returncode == 0, f"hipcc failed for {src.name}:\n{' '.join(cmd)}\n{proc.stderr[-4000:]}"
            asm = sorted(work.glob(f"*-hip-amdgcn-amd-amdhsa-{ARCH}.s"))
            assert asm, f"hipcc -save-temps wrote no {ARCH} assembly for {src.name}"
            cache[src] = (obj, proc.stderr, asm[0].read_text())
        return cache[src]

    return get


@pytest.mark.parametrize("src", CU_FILES, ids=[p.name for p in CU_FILES])
def test_cu_file_compiles_for_gfx90a(src, compiled):
    obj, stderr, asm = compiled(src)
    assert obj.stat().st_size > 0
    assert "warning" not in stderr.lower(), stderr
    kernels = re.findall(r"^\s*\.amdhsa_kernel\s+(\S+)", asm, re.M)
    assert kernels, f"no kernels in the {ARCH} code of {src.name}"
    # every kernel is a 64-lane wave, and the warp reductions became cross-lane instructions
    waves = re.findall(r"\.wavefront_size:\s+(\d+)", asm)
    assert len(waves) == len(kernels) and set(waves) == {"64"}, (src.name, waves)
    assert "ds_bpermute_b32" in asm or "_dpp" in asm or "ds_swizzle" in asm, f"{src.name}: no cross-lane exchange"


_SQRT_PROBE = """
#include <hip/hip_runtime.h>
%s
__global__ void probe(float* p) { p[threadIdx.x] = __fsqrt_rn(p[threadIdx.x]); }
"""


def test_fsqrt_rn_is_correctly_rounded_under_the_compat_header(hipcc, monkeypatch, tmp_path):
    """HIP's __fsqrt_rn is the bare hardware square root (v_sqrt_f32, about 1 ulp); the fused step's __fsqrt_rn,
    through gpu_compat.h, is sqrtf under -fhip-fp32-correctly-rounded-divide-sqrt: the hardware root corrected by
    the residuals of its neighbours (two FMAs), as the reference's IEEE square root needs."""
    flags = [f for f in rocm_jit_flags(monkeypatch) if f != "-O3"]
    counts = {}
    for name, include in (("hip", ""), ("compat", '#include "gpu_compat.h"')):
        src = tmp_path / f"{name}.hip"
        src.write_text(_SQRT_PROBE % include)
        asm = tmp_path / f"{name}.s"
        proc = subprocess.run([hipcc, "-x", "hip", "-O3", *flags, "-I", str(CSRC / "cuda"), "--cuda-device-only",
                               "-S", str(src), "-o", str(asm)], capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, HIP_PLATFORM="amd"))
        assert proc.returncode == 0, proc.stderr[-4000:]
        text = asm.read_text()
        counts[name] = (text.count("v_sqrt_f32"), text.count("v_fma_f32"))
    assert counts["hip"] == (1, 0) and counts["compat"][0] == 1 and counts["compat"][1] >= 2, counts
