"""Optimizer-step benchmark: FP4AdamW (fused CPU step) against its peers, in the same process, interleaved.

Peers: DeepSpeedCPUAdam (JIT-builds its cpu_adam op on first use, DS_ACCELERATOR=cpu), torch AdamW(fused=True)
and torchao's AdamW4bit when installed. Each round times one step of every optimizer in turn, so a drift in
the host's memory bandwidth hits them alike; the table reports the median over rounds.

Also reports the host bytes per parameter each optimizer holds for m and v (measured from its tensors) and,
for FP4AdamW, for the master weight (``fp4adamw_bf16_*``: a bf16 parameter with an fp32, split or bf16
master; ``fp4adamw_norm``: the engine's gradient norm given, so the non-finite pass over the gradients is
skipped, as under DeepSpeed; ``fp4adamw_clip_g32`` / ``fp4adamw_clip_g16``: an fp32 master with a clipping factor
handed over, as under DeepSpeed ZeRO-3, its gradient fp32 or the bf16 gradient partition (the fused step applies
the factor as it reads each gradient); ``fp4adamw_noclip_g16``
the same at factor 1, no clipping; ``fp4adamw_vnearest`` / ``fp4adamw_vsr``: sqrt(v) rounded to nearest /
stochastically; ``fp4adamw_ufp4`` / ``fp4adamw_ue2m0``: sqrt(v) on the ufp4 / the 2-bit ue2m0 grid instead of
ue2m2),
and the NVMe tier: seconds per step with states in files against the same step in RAM, bytes written per step.

CPU paths: an arm named ``<optimizer>@<path>`` runs on that vector path (``fp4adamw@avx2``: FP4AdamW's step
forced to the AVX2 build, as FP4OFFLOAD_CPU_ISA=avx2 does; ``deepspeed_cpu_adam@avx2``: DeepSpeed's cpu_adam
op built as its ``__AVX256__`` variant with ``-mavx2 -mfma -mf16c``, its own module name). Each row's ratio is
against DeepSpeedCPUAdam on the same path (``deepspeed_cpu_adam@<path>``, or the plain arm: DeepSpeed's own
build, ``-march=native``). Each row also gives the host bytes one step moves per parameter, the GB/s that makes,
and its share of this machine's stream bandwidth (an in-place pass over 1 GiB, timed in the same rounds: the
optimizers update their tensors in place too).

``--residual-numel``: the split master with its residual in RAM (``master_device="same"``) against the residual
in the state files (``"nvme"``), NVMe tier for both, each in its own process so that each has its own peak RSS:
seconds per step, bytes moved per step, host bytes held for the master, RSS between and during steps; the two
must end on the same parameter, bit for bit.

    python benchmarks/optimizer.py --numel 64M --threads 2 --rounds 15 [--json] [--nvme-path /tmp/x]
        [--nvme-io aio,threads]
    python benchmarks/optimizer.py --optimizers none --nvme-numel 0 --residual-numel 64M --nvme-io threads,aio
    python benchmarks/optimizer.py --numel 16M --threads 2 --optimizers \
        deepspeed_cpu_adam,fp4adamw,fp4adamw_norm,fp4adamw_clip_g16,deepspeed_cpu_adam@avx2,fp4adamw@avx2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/fp4offload/torch_extensions"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch


def _numel(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KMG" else s) * mult)


def _tensor_bytes(t: torch.Tensor) -> int:
    if hasattr(t, "__tensor_flatten__"):  # a tensor subclass (torchao's 4-bit state): count its inner tensors
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def _state_bytes(opt) -> int:
    """Bytes of the optimizer's per-parameter state tensors other than the step count and an fp32 master."""
    total = 0
    for st in opt.state.values():
        for k, t in st.items():
            if torch.is_tensor(t) and k not in ("step", "master", "master_lo", "master_odd") and t.numel() > 1:
                total += _tensor_bytes(t)
    return total


class _StepThenEncode:
    """An optimizer step followed by the codec's NVFP4 16x16 encode of the new weight (a separate pass)."""

    def __init__(self, opt, p):
        self.opt, self.p = opt, p
        self.state = opt.state

    def step(self):
        from fp4offload import quantize

        self.opt.step()
        self.copy = quantize(self.p.detach(), "nvfp4", block="16x16")


class _Clipped:
    """A step with the engine's gradient scale handed to FP4AdamW (``hooks.scale_grad``), as DeepSpeed ZeRO-3's
    clipping is under the block: `scale` 1 is the factor when no clipping happens (no pass over the gradient)."""

    def __init__(self, opt, p, scale: float):
        self.opt, self.p, self.scale = opt, p, scale
        self.state = opt.state

    def step(self):
        self.opt.hooks.scale_grad(self.p, self.scale)
        self.opt.step()

    def master_bytes(self):
        return self.opt.master_bytes()


class _on_path:
    """FP4OFFLOAD_CPU_ISA set to `isa` inside the block (FP4AdamW picks its step's build at each step)."""

    def __init__(self, isa: str):
        self.isa = isa

    def __enter__(self):
        from fp4offload._ops import cpu_isa

        self.before = os.environ.get(cpu_isa.ENV)
        os.environ[cpu_isa.ENV] = self.isa

    def __exit__(self, *exc):
        from fp4offload._ops import cpu_isa

        if self.before is None:
            os.environ.pop(cpu_isa.ENV, None)
        else:
            os.environ[cpu_isa.ENV] = self.before


class _OnPath:
    """An optimizer whose steps run on the CPU path `isa`."""

    def __init__(self, opt, isa: str):
        self.opt, self.isa, self.state = opt, isa, opt.state

    def step(self):
        with _on_path(self.isa):
            self.opt.step()

    def master_bytes(self):
        return self.opt.master_bytes()


def _deepspeed_on_path(p, lr: float, isa: str):
    """DeepSpeedCPUAdam whose op is DeepSpeed's cpu_adam built for `isa` (avx512: ``__AVX512__`` with the
    AVX-512 flags fp4offload's build uses; avx2: ``__AVX256__`` with -mavx2 -mfma -mf16c), under its own name."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.ops.op_builder.cpu import CPUAdamBuilder

    from fp4offload._ops import cpu_isa

    flags = {"avx512": ("-D__AVX512__", " ".join(cpu_isa.row("avx512").flags)),
             "avx2": ("-D__AVX256__", "-mavx2 -mfma -mf16c")}
    if isa not in flags:
        raise ValueError(f"no DeepSpeed cpu_adam build for the {isa} path here")
    simd, arch = flags[isa]

    class Builder(CPUAdamBuilder):
        NAME = f"cpu_adam_{isa}"

        def __init__(self):
            super().__init__()
            self.name = self.NAME

        def absolute_name(self):
            return f"deepspeed.ops.adam.{self.NAME}_op"

        def cpu_arch(self):
            return arch

        def simd_width(self):
            return simd

    op = Builder().load()
    opt = DeepSpeedCPUAdam([p], lr=lr, adamw_mode=True)
    opt.ds_opt_adam = op
    group = opt.param_groups[0]
    op.create_adam(opt.opt_id, group["lr"], group["betas"][0], group["betas"][1], group["eps"],
                   group["weight_decay"], True, False)
    return opt


def make_optimizers(n: int, lr: float, which: list[str]):
    """name -> (optimizer, param) with its own copy of the same data."""
    out = {}
    base = torch.randn(n, generator=torch.Generator().manual_seed(0)) * 0.02
    grad = torch.randn(n, generator=torch.Generator().manual_seed(1)) * 1e-3

    def param(shape=None):
        p = torch.nn.Parameter(base.clone() if shape is None else base.clone().view(shape))
        p.grad = grad.clone() if shape is None else grad.clone().view(shape)
        return p

    mat = (n // 8192, 8192) if n % 8192 == 0 else (n // 64, 64)  # a weight matrix for the working-copy variants

    for full in which:
        name, _, isa = full.partition("@")
        try:
            if isa and name == "deepspeed_cpu_adam":
                p = param()
                out[full] = (_deepspeed_on_path(p, lr, isa), p)
                continue
            if isa:
                from fp4offload._ops import cpu_isa

                if isa not in cpu_isa.available():
                    raise ValueError(f"this CPU has no {isa} path ({', '.join(cpu_isa.available())})")
                with _on_path(isa):
                    one = make_optimizers(n, lr, [name])
                if name in one:
                    out[full] = (_OnPath(one[name][0], isa), one[name][1])
                continue
            if name == "fp4adamw":
                from fp4offload import FP4AdamW
                from fp4offload._optim import StepOptions

                p = param()
                # the defaults: stochastic m, checked
                out[name] = (FP4AdamW([p], lr=lr, step_options=StepOptions(backend="fused")), p)
            elif name == "fp4adamw_nearest":
                from fp4offload import FP4AdamW
                from fp4offload._optim import StateFormat, StepOptions

                p = param()
                out[name] = (FP4AdamW([p], lr=lr, state_format=StateFormat(m_rounding="nearest"),
                                      step_options=StepOptions(backend="fused")), p)
            elif name in ("fp4adamw_vnearest", "fp4adamw_vsr"):  # sqrt(v) rounded to nearest / stochastically
                from fp4offload import FP4AdamW
                from fp4offload._optim import StateFormat, StepOptions

                p = param()
                vr = "nearest" if name == "fp4adamw_vnearest" else "stochastic"
                out[name] = (FP4AdamW([p], lr=lr, state_format=StateFormat(v_rounding=vr),
                                      step_options=StepOptions(backend="fused")), p)
            elif name in ("fp4adamw_ufp4", "fp4adamw_ue2m0"):  # sqrt(v) on ufp4 (before 2026-12-03) / 2 bits
                from fp4offload import FP4AdamW
                from fp4offload._optim import StateFormat, StepOptions

                p = param()
                out[name] = (FP4AdamW([p], lr=lr, state_format=StateFormat(v_format=name.split("_")[1]),
                                      step_options=StepOptions(backend="fused")), p)
            elif name == "fp4adamw_nocheck":  # without the non-finite gradient pass (DeepSpeedCPUAdam has none)
                from fp4offload import FP4AdamW
                from fp4offload._optim import StepOptions

                p = param()
                out[name] = (FP4AdamW([p], lr=lr, step_options=StepOptions(backend="fused", skip_nonfinite=False)), p)
            elif name == "fp4adamw_norm":  # the engine's global norm replaces the non-finite pass (DeepSpeed)
                from fp4offload import FP4AdamW
                from fp4offload._optim import StepOptions

                p = param()
                opt = FP4AdamW([p], lr=lr, step_options=StepOptions(backend="fused"))
                opt.hooks.grad_norm_source(lambda: 1.0)
                out[name] = (opt, p)
            elif name.startswith("fp4adamw_bf16_"):  # a bf16 parameter (bf16 gradient) with each master form
                from fp4offload import FP4AdamW
                from fp4offload._optim import StepOptions

                p = torch.nn.Parameter(base.to(torch.bfloat16))
                p.grad = grad.to(torch.bfloat16)
                master = {"fp4adamw_bf16_m32": "fp32", "fp4adamw_bf16_split": "split",
                          "fp4adamw_bf16_mbf16": "bf16"}[name]
                out[name] = (FP4AdamW([p], lr=lr, master=master, step_options=StepOptions(backend="fused")), p)
            elif name in ("fp4adamw_clip_g32", "fp4adamw_clip_g16", "fp4adamw_noclip_g16"):
                # ZeRO-3's fp32 master under the block: its gradient an fp32 buffer or DeepSpeed's bf16 gradient
                # partition, a clipping factor of 0.999 (applied as the step reads the gradient), or none
                from fp4offload import FP4AdamW
                from fp4offload._optim import StepOptions
                from fp4offload._deepspeed.at_init import set_grad as _set_grad

                p = param()
                if name.endswith("g16"):
                    _set_grad(p, grad.to(torch.bfloat16))
                scale = 1.0 if "noclip" in name else 0.999
                opt = FP4AdamW([p], lr=lr, step_options=StepOptions(backend="fused", skip_nonfinite=False))
                out[name] = (_Clipped(opt, p, scale), p)
            elif name == "fp4adamw_wcopy":  # + the NVFP4 16x16 working copy, written inside the fused step
                from fp4offload import FP4AdamW
                from fp4offload._optim import StepOptions

                p = param(mat)
                out[name] = (FP4AdamW([p], lr=lr, step_options=StepOptions(backend="fused", working_copy="nvfp4")), p)
            elif name == "fp4adamw_wcopy_separate":  # the same copy made by a pass of its own after the step
                from fp4offload import FP4AdamW
                from fp4offload._optim import StepOptions

                p = param(mat)
                out[name] = (_StepThenEncode(FP4AdamW([p], lr=lr, step_options=StepOptions(backend="fused")), p), p)
            elif name == "deepspeed_cpu_adam":
                from deepspeed.ops.adam import DeepSpeedCPUAdam

                p = param()
                out[name] = (DeepSpeedCPUAdam([p], lr=lr, adamw_mode=True), p)
            elif name == "torch_adamw_fused":
                p = param()
                out[name] = (torch.optim.AdamW([p], lr=lr, fused=True), p)
            elif name == "torchao_adamw4bit":
                from torchao.optim import AdamW4bit

                p = param()
                out[name] = (AdamW4bit([p], lr=lr), p)
        except Exception as e:  # a peer that is not installed or does not build is reported, not fatal
            print(f"# {full}: unavailable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})",
                  file=sys.stderr)
    return out


#: host bytes one step moves per parameter (read + written), by optimizer (without its @path): fp32 Adam reads and
#: writes the parameter, m and v and reads the gradient; FP4AdamW moves packed m and v (2 x (0.5 + 1/16 + 4/1024) B
#: each way) instead, reads the gradient a second time for its non-finite check unless the engine's norm is given
#: (`_norm`, `_clip_*`, `_noclip_*`, `_nocheck`), and a bf16 gradient is 2 B (a clipping factor is applied as the
#: fused step reads the gradient: no pass of its own)
_FP4_STATES = 2 * 2 * (0.5 + 1 / 16 + 4 / 1024)
_UE2M0_STATES = 2 * (0.5 + 1 / 16 + 4 / 1024) + 2 * (0.25 + 1 / 16 + 4 / 1024)  # v's codes 2 bits


def bytes_per_param(name: str) -> float | None:
    name = name.partition("@")[0]
    if name in ("deepspeed_cpu_adam", "torch_adamw_fused"):
        return 28.0
    if name in ("fp4adamw", "fp4adamw_nearest", "fp4adamw_vnearest", "fp4adamw_vsr", "fp4adamw_ufp4"):
        return 8 + 4 + 4 + _FP4_STATES
    if name == "fp4adamw_ue2m0":
        return 8 + 4 + 4 + _UE2M0_STATES
    if name in ("fp4adamw_norm", "fp4adamw_nocheck", "fp4adamw_clip_g32"):
        return 8 + 4 + _FP4_STATES
    if name in ("fp4adamw_clip_g16", "fp4adamw_noclip_g16"):
        return 8 + 2 + _FP4_STATES
    return None


def bench_step(n: int, rounds: int, which: list[str], lr: float = 1e-3) -> list[dict]:
    opts = make_optimizers(n, lr, which)
    for opt, _ in opts.values():  # warm up: state allocation, JIT builds, first-touch page faults
        opt.step()
        opt.step()
    # the reference stream: an in-place pass (read and write back, as the optimizers update their tensors, so no
    # write-allocate reads) over 1 GiB, past the last-level cache of the machines measured here (up to 260 MiB)
    stream = torch.ones(max(n, 1 << 28))
    stream.mul_(1.0)
    times = {k: [] for k in opts}
    copy_t = []
    for _ in range(rounds):
        for name, (opt, _) in opts.items():
            t0 = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        stream.mul_(1.0)  # 4 B read + 4 B written per element
        copy_t.append(time.perf_counter() - t0)
    copy_gbps = 8 * stream.numel() / statistics.median(copy_t) / 1e9
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        isa = name.partition("@")[2]
        peer = f"deepspeed_cpu_adam@{isa}" if isa and f"deepspeed_cpu_adam@{isa}" in times else "deepspeed_cpu_adam"
        ds = statistics.median(times[peer]) if peer in times else None
        bpp = bytes_per_param(name)
        gbps = bpp * n / med / 1e9 if bpp else None
        rows.append({"bench": "step", "optimizer": name, "numel": n, "threads": torch.get_num_threads(),
                     "median_s": med, "min_s": min(ts), "updates_per_s": n / med,
                     "vs_deepspeed": (ds / med) if ds else None, "peer": peer if ds else None,
                     "bytes_per_param": bpp, "gbps": gbps, "copy_gbps": copy_gbps,
                     "copy_share": gbps / copy_gbps if gbps else None,
                     "state_bytes_per_param": _state_bytes(opts[name][0]) / n,
                     "master_bytes_per_param": (opts[name][0].master_bytes()["host"] / n
                                                if hasattr(opts[name][0], "master_bytes") else None)})
    return rows


def bench_nvme(n: int, rounds: int, path: str | None, io: str = "auto") -> list[dict]:
    """FP4AdamW with states in files (I/O engine `io`: auto, aio, threads) against the same step in RAM."""
    from fp4offload import FP4AdamW
    from fp4offload import _metrics as metrics
    from fp4offload._optim import NvmeOptions, StepOptions

    folder = path or tempfile.mkdtemp(prefix="fp4-nvme-bench-")
    base = torch.randn(n, generator=torch.Generator().manual_seed(0)) * 0.02
    grad = torch.randn(n, generator=torch.Generator().manual_seed(1)) * 1e-3
    pr, pd = torch.nn.Parameter(base.clone()), torch.nn.Parameter(base.clone())
    pr.grad, pd.grad = grad.clone(), grad.clone()
    ram = FP4AdamW([pr], lr=1e-3, step_options=StepOptions(backend="fused"))
    disk = FP4AdamW([pd], lr=1e-3, state_device="nvme", nvme_path=folder, nvme=NvmeOptions(io=io),
                    step_options=StepOptions(backend="fused"))
    engine, why = disk.nvme_io, disk.placement.store.io_reason
    ram.step()
    disk.step()
    tr, td = [], []
    w0 = metrics.counter("optim.nvme.bytes_written").value
    r0 = metrics.counter("optim.nvme.bytes_read").value
    for _ in range(rounds):
        t0 = time.perf_counter()
        ram.step()
        tr.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        disk.step()
        td.append(time.perf_counter() - t0)
    written = (metrics.counter("optim.nvme.bytes_written").value - w0) / rounds
    read = (metrics.counter("optim.nvme.bytes_read").value - r0) / rounds
    assert torch.equal(pr.detach(), pd.detach())
    disk.close()
    return [{"bench": "nvme", "numel": n, "folder": folder, "io": engine, "io_note": why,
             "ram_s": statistics.median(tr),
             "nvme_s": statistics.median(td), "slowdown": statistics.median(td) / statistics.median(tr),
             "bytes_written_per_step": written, "bytes_read_per_step": read,
             "bytes_per_param_written": written / n}]


def residual_child(n: int, steps: int, folder: str, io: str, where: str) -> dict:
    """One run of the split master with its residual ``where`` ("same": RAM, "nvme": the state files)."""
    import hashlib
    import threading

    from fp4offload import FP4AdamW
    from fp4offload import _metrics as metrics
    from fp4offload._optim import NvmeOptions, StepOptions

    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter((torch.randn(n, generator=g) * 0.02).to(torch.bfloat16))
    grad = (torch.randn(n, generator=g) * 1e-2).to(torch.bfloat16)
    p.grad = grad
    opt = FP4AdamW([p], lr=1e-3, master="split", state_device="nvme", nvme_path=folder,
                   nvme=NvmeOptions(io=io, master_device=where), step_options=StepOptions(metrics_every=0))
    opt.step()  # the first step allocates the states and writes the files
    opt.step()

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    between, peak, stop = rss(), [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            stop.wait(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    keys = ("optim.nvme.bytes_written", "optim.nvme.bytes_read")
    c0 = {k: metrics.counter(k).value for k in keys}
    wall, cpu = [], []
    for _ in range(steps):
        t, c = time.perf_counter(), time.process_time()
        opt.step()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    stop.set()
    sampler.join()
    moved = {k.rsplit("_", 1)[1]: (metrics.counter(k).value - c0[k]) / steps / n for k in keys}
    out = {"bench": "residual", "numel": n, "io": opt.nvme_io, "master_device": where,
           "step_s": statistics.median(wall), "cpu_s": statistics.median(cpu),
           "written_B_per_param": moved["written"], "read_B_per_param": moved["read"],
           "files_bytes": opt.placement.tier.disk_bytes(), "master_bytes": opt.master_bytes(),
           "rss_between_steps": between, "rss_peak_in_steps": max(peak[0], between),
           "param_sha256": hashlib.sha256(p.detach().view(torch.int16).numpy().tobytes()).hexdigest()}
    opt.close()
    return out


def bench_residual(n: int, rounds: int, path: str | None, io: str) -> list[dict]:
    """residual_child for "same" and "nvme", each in a fresh process; asserts they end on the same parameter."""
    import subprocess

    rows = []
    for where in ("same", "nvme"):
        with tempfile.TemporaryDirectory(prefix="fp4-residual-bench-", dir=path) as folder:
            cmd = [sys.executable, __file__, "--residual-child", where, "--residual-numel", str(n), "--rounds",
                   str(rounds), "--nvme-io", io, "--nvme-path", folder, "--threads", str(torch.get_num_threads())]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"residual child ({where}, {io}) failed:\n{done.stderr[-4000:]}")
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    if rows[0]["param_sha256"] != rows[1]["param_sha256"]:
        raise AssertionError("the residual in RAM and in the state files gave different parameters")
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", default="64M", help="parameters in the flat fp32 tensor (default 64M = 2^26)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--optimizers", default="fp4adamw,fp4adamw_nearest,fp4adamw_nocheck,deepspeed_cpu_adam,"
                                            "torch_adamw_fused,torchao_adamw4bit")
    ap.add_argument("--nvme-numel", default="16M", help="parameters for the NVMe-tier comparison (0: skip)")
    ap.add_argument("--nvme-path", default=None, help="folder for the NVMe tier (default: a temporary folder)")
    ap.add_argument("--nvme-io", default="auto", help="I/O engine(s) of the NVMe tier, comma-separated: auto, aio, "
                                                      "threads (default auto: aio when DeepSpeed's async_io loads)")
    ap.add_argument("--residual-numel", default="0",
                    help="parameters for the split master's residual in RAM against in the state files (0: skip)")
    ap.add_argument("--residual-child", choices=("same", "nvme"), help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.residual_child:
        print(json.dumps(residual_child(_numel(a.residual_numel), a.rounds, a.nvme_path, a.nvme_io,
                                        a.residual_child)))
        return
    which = [w for w in a.optimizers.split(",") if w and w != "none"]
    rows = bench_step(_numel(a.numel), a.rounds, which) if which else []
    if _numel(a.nvme_numel):
        for io in a.nvme_io.split(","):
            rows += bench_nvme(_numel(a.nvme_numel), max(3, a.rounds // 3), a.nvme_path, io.strip())
    if _numel(a.residual_numel):
        for io in a.nvme_io.split(","):
            rows += bench_residual(_numel(a.residual_numel), max(3, a.rounds // 3), a.nvme_path, io.strip())
    if a.json:
        for r in rows:
            print(json.dumps(r))
        return
    if any(r["bench"] == "step" for r in rows):
        copy = next(r["copy_gbps"] for r in rows if r["bench"] == "step")
        print(f"stream bandwidth in the same rounds (in-place read + write, 1 GiB): {copy:.1f} GB/s")
        print("| optimizer | params | threads | median step (s) | updates/s | vs DeepSpeedCPUAdam (same path) | "
              "m+v bytes/param | bytes moved/param | GB/s | share of stream |")
        print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["bench"] == "step":
            vs = f"{r['vs_deepspeed']:.2f}x" if r["vs_deepspeed"] else "-"
            moved = (f"{r['bytes_per_param']:.2f} | {r['gbps']:.1f} | {100 * r['copy_share']:.0f}%"
                     if r["bytes_per_param"] else "- | - | -")
            print(f"| {r['optimizer']} | {r['numel']} | {r['threads']} | {r['median_s']:.4f} | "
                  f"{r['updates_per_s'] / 1e6:.1f} M | {vs} | {r['state_bytes_per_param']:.3f} | {moved} |")
    for r in rows:
        if r["bench"] == "nvme":
            note = f" (aio unavailable: {r['io_note']})" if r["io_note"] else ""
            print(f"\nNVMe tier ({r['io']} I/O{note}), {r['numel']} params in {r['folder']}: {r['nvme_s']:.3f} s/step "
                  f"vs {r['ram_s']:.3f} "
                  f"in RAM ({r['slowdown']:.2f}x); {r['bytes_written_per_step'] / 2**20:.1f} MiB written and "
                  f"{r['bytes_read_per_step'] / 2**20:.1f} MiB read per step "
                  f"({r['bytes_per_param_written']:.3f} B/param)")
    res = [r for r in rows if r["bench"] == "residual"]
    if res:
        print("\n| split's residual | io | params | s/step | CPU s/step | written = read B/param | master host bytes "
              "| RSS between steps | peak RSS in steps |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in res:
            print(f"| {'RAM' if r['master_device'] == 'same' else 'state files'} | {r['io']} | {r['numel']} | "
                  f"{r['step_s']:.3f} | {r['cpu_s']:.3f} | {r['written_B_per_param']:.3f} | "
                  f"{r['master_bytes']['host']:,} | {r['rss_between_steps'] / 2**20:.0f} MiB | "
                  f"{r['rss_peak_in_steps'] / 2**20:.0f} MiB |")


if __name__ == "__main__":
    main()
