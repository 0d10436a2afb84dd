"""The CUDA sources compile with nvcc, with the flags the JIT build uses, for sm_90 and sm_100a.

Runs wherever nvcc is on PATH (no GPU needed). Every csrc/cuda/*.cu file is compiled, so kernels added
later are checked too, and every binding (csrc/cuda/*.cpp) is syntax-checked against torch's headers. For
the codecs it also proves the sm_100a guard: the sm_100a build contains the E2M1 conversion instruction
(PTX cvt.rn.satfinite.e2m1x2.f32, SASS F2FP...E2M1) and the sm_90 build does not.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from fp4offload._ops import build, cuda

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
CU_FILES = sorted((CSRC / "cuda").glob("*.cu"))
BINDINGS = sorted((CSRC / "cuda").glob("*.cpp"))
ARCHS = ["90", "100a"]
NVCC = shutil.which("nvcc")
CVT_PTX = "cvt.rn.satfinite.e2m1x2.f32"

pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH: the CUDA sources are compile-checked "
                                                      "only where the CUDA toolkit is installed")


def jit_nvcc_flags(arch: str) -> list[str]:
    """The nvcc flags fp4offload._ops.build passes to torch's JIT builder for `arch`, read off the real call."""
    from torch.utils import cpp_extension

    seen = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpp_extension, "load", lambda **kw: seen.update(kw))
        mp.setattr(build, "cached", lambda *a: None)  # never a cached library imported instead of calling load
        build.build("fp4offload_cuda", cuda.SOURCES, cuda=True, extra_cuda_cflags=cuda.nvcc_flags([arch]))
    flags = list(seen["extra_cuda_cflags"])
    # torch adds these for every CUDA source (torch.utils.cpp_extension.COMMON_NVCC_FLAGS)
    flags += list(getattr(cpp_extension, "COMMON_NVCC_FLAGS", []))
    return flags


def _tool(name: str) -> str | None:
    """A CUDA binary utility: on PATH, beside nvcc, or from the nvidia-cuda-* wheels."""
    found = shutil.which(name)
    if found:
        return found
    beside = Path(os.path.realpath(NVCC)).parent / name
    if beside.exists():
        return str(beside)
    try:
        import nvidia

        for base in nvidia.__path__:
            for cand in sorted(Path(base).glob(f"cu*/bin/{name}")):
                return str(cand)
    except ImportError:
        pass
    return None


def _compile(src: Path, arch: str, flags: list[str], out_dir: Path) -> tuple[Path, str]:
    obj = out_dir / f"{src.stem}.sm_{arch}.o"
    keep = out_dir / f"keep_{src.stem}_{arch}"
    keep.mkdir()
    cmd = [NVCC, *flags, "-Xcompiler", "-fPIC", "-I", str(CSRC), "-c", str(src), "-o", str(obj), "-keep",
           "-keep-dir", str(keep)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"nvcc failed for {src.name} (sm_{arch}):\n{' '.join(cmd)}\n{proc.stderr[-4000:]}"
    return obj, proc.stderr


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """(src, arch) -> (object file, nvcc stderr, -keep folder), each compiled once per test run."""
    out_dir = tmp_path_factory.mktemp("nvcc")
    cache: dict = {}

    def get(src: Path, arch: str):
        if (src, arch) not in cache:
            obj, stderr = _compile(src, arch, jit_nvcc_flags(arch), out_dir)
            cache[(src, arch)] = (obj, stderr, out_dir / f"keep_{src.stem}_{arch}")
        return cache[(src, arch)]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_jit_flags_are_exact_ieee(arch):
    flags = jit_nvcc_flags(arch)
    assert "--fmad=false" in flags and "-O3" in flags and "-std=c++17" in flags
    assert "--prec-div=true" in flags and "--ftz=false" in flags
    assert not any("fast_math" in f or "fast-math" in f for f in flags)
    assert f"-gencode=arch=compute_{arch},code=sm_{arch}" in flags


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("src", CU_FILES, ids=[p.name for p in CU_FILES])
def test_cu_file_compiles(src, arch, compiled):
    obj, stderr, _ = compiled(src, arch)
    assert obj.stat().st_size > 0
    assert "warning" not in stderr.lower(), stderr


def test_sm100a_build_uses_the_e2m1_instruction_and_sm90_does_not(compiled):
    src = CSRC / "cuda" / "fp4_kernels.cu"
    ptx, sass = {}, {}
    cuobjdump = _tool("cuobjdump")
    for arch in ARCHS:
        obj, _, keep = compiled(src, arch)
        ptx_files = list(keep.glob("*.ptx"))
        assert ptx_files, "nvcc -keep wrote no PTX"
        ptx[arch] = "".join(p.read_text() for p in ptx_files)
        if cuobjdump:
            env = dict(os.environ, PATH=f"{Path(cuobjdump).parent}{os.pathsep}{os.environ.get('PATH', '')}")
            proc = subprocess.run([cuobjdump, "-sass", str(obj)], capture_output=True, text=True, timeout=300, env=env)
            if proc.returncode == 0:
                sass[arch] = proc.stdout
    assert CVT_PTX in ptx["100a"], "the sm_100a build lost the hardware E2M1 path (check the guard macros)"
    assert CVT_PTX not in ptx["90"], "the sm_90 build contains an sm_100a-only instruction"
    if len(sass) == len(ARCHS):  # cuobjdump (with nvdisasm) available: the machine code agrees
        assert "E2M1" in sass["100a"] and "E2M1" not in sass["90"]


def test_arch_flags_pick_arch_specific_targets_from_sm100(monkeypatch):
    assert cuda._arch_for(9, 0) == "90"
    assert cuda._arch_for(8, 6) == "86"
    assert cuda._arch_for(10, 0) == "100a"
    assert cuda._arch_for(12, 0) == "120a"
    monkeypatch.setenv("FP4OFFLOAD_CUDA_ARCH", "90, sm_100a")
    assert cuda.arch_flags() == ["-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_100a,code=sm_100a"]
    # any 'arch' flag makes torch add none of its own, so the build holds exactly these targets
    from torch.utils import cpp_extension

    assert cpp_extension._get_cuda_arch_flags(cuda.nvcc_flags(["90"])) == []


@pytest.mark.slow
@pytest.mark.parametrize("src", BINDINGS, ids=[p.name for p in BINDINGS])
def test_binding_compiles_against_torch_headers(src, tmp_path):
    """Each torch binding (fp4_cuda.cpp, adam_cuda.cpp) is valid C++ against this torch's headers (a syntax
    check; the link needs a CUDA torch)."""
    import torch

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler on PATH")
    tinc = Path(torch.__file__).parent / "include"
    if not (tinc / "c10" / "cuda" / "CUDAStream.h").exists():
        pytest.skip("this torch ships no c10/cuda headers")
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), str(Path(os.path.realpath(NVCC)).parents[1]),
             "/usr/local/cuda"]
    cuda_inc = next((Path(h) / "include" for h in homes if h and (Path(h) / "include" / "cuda_runtime_api.h").exists()),
                    None)
    if cuda_inc is None:
        pytest.skip("cuda_runtime_api.h not found (set CUDA_HOME)")
    incs = [str(tinc), str(tinc / "torch" / "csrc" / "api" / "include"), sysconfig.get_paths()["include"],
            str(cuda_inc)]
    if not (tinc / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").exists():  # generated only in CUDA builds
        stub = tmp_path / "c10" / "cuda" / "impl"
        stub.mkdir(parents=True)
        (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        incs.append(str(tmp_path))
    cmd = [cxx, "-std=c++20", "-fsyntax-only", "-Wall", "-DTORCH_EXTENSION_NAME=fp4offload_cuda",
           "-DTORCH_API_INCLUDE_EXTENSION_H", "-I", str(CSRC)]
    for inc in incs:
        cmd += ["-isystem", inc]
    cmd.append(str(src))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "warning" not in proc.stderr.lower(), proc.stderr
