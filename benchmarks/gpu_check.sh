#!/usr/bin/env bash
# gpu_check.sh: the prepared check of the CUDA backend for a lent GPU (an H200: 15 minutes of device
# time in all, so this stays under about 8 minutes and survives any step failing).
#
#   bash benchmarks/gpu_check.sh            # from anywhere; runs in the repository root
#
# Steps (each PASS/FAIL with its time, under its own `timeout`; a summary table closes the run):
#   env      nvidia-smi -L, compute capability, nvcc, python, torch
#   deps     a CUDA torch (pip install torch==2.13.0 only if torch is missing or CPU-only; the lent
#            machines have no network, so this is a fallback) and psutil pyyaml nvidia-ml-py ninja
#            pytest if missing; `pip install -e . --no-deps`; PYTHONPATH points at the tree either way
#   build    JIT-build the CUDA extension (timed) and report whether the sm_100a E2M1 path is active
#   compile  tests/test_cuda_compile.py (nvcc compile checks, sm_90 + sm_100a)
#   gpu      pytest -m gpu (bytes == reference on every format, dtype, rounding, shape)
#   speed    a quick encode/decode throughput probe of the codecs (CUDA events; JSON lines)
#   bench:*  python -m benchmarks.codec --device cuda --json if present, and every other benchmarks/*.py
#            that takes --device, each under `timeout`
# Everything printed also goes to $OUT/gpu_check.log when OUT is set. Exit status 0 iff every step passed.
# GPU_CHECK_NO_PIP=1 skips every pip call (a dry run on a development machine).
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)

TEE_PID=""
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  exec > >(tee -a "$OUT/gpu_check.log") 2>&1
  TEE_PID=$!
fi

BUDGET_S=${GPU_CHECK_BUDGET_S:-480}   # the whole run; each step's limit is cut to what is left
T_START=$(date +%s)
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 MAX_JOBS=${MAX_JOBS:-16}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/fp4offload/torch_extensions}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PIP_FAST=(--retries 0 --timeout 15 -q)

STEP_NAMES=()
STEP_STATUS=()
STEP_SECS=()

elapsed() { echo $(($(date +%s) - T_START)); }

# step NAME LIMIT_S COMMAND: runs COMMAND (a bash string) under timeout, records PASS/FAIL/SKIP.
step() {
  local name=$1 limit=$2 cmd=$3 t0 rc status left
  left=$((BUDGET_S - $(elapsed)))
  if [ "$left" -lt 20 ]; then
    echo "=== [$name] SKIP: the ${BUDGET_S}s budget is spent"
    STEP_NAMES+=("$name"); STEP_STATUS+=("SKIP"); STEP_SECS+=(0)
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo
  echo "=== [$name] (limit ${limit}s, t=$(elapsed)s)"
  t0=$(date +%s)
  set +e
  timeout --kill-after=10 "$limit" bash -c "$cmd"
  rc=$?
  if [ "$rc" -eq 0 ]; then status=PASS; elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status="FAIL(timeout)"; else status="FAIL(rc=$rc)"; fi
  STEP_NAMES+=("$name"); STEP_STATUS+=("$status"); STEP_SECS+=($(($(date +%s) - t0)))
  echo "=== [$name] $status in $(($(date +%s) - t0))s"
}

# The interpreter that holds torch (the lent machines' python3 does).
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for cand in python3 python; do
    if command -v "$cand" >/dev/null && "$cand" -c "import torch" >/dev/null 2>&1; then PY=$cand; break; fi
  done
  PY=${PY:-python3}
fi
export PY

# CUDA_HOME for torch's JIT builder: the toolkit that holds nvcc and cuda_runtime_api.h.
if [ -z "${CUDA_HOME:-}" ]; then
  for cand in "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc 2>/dev/null || echo /nonexistent)")")")" /usr/local/cuda; do
    if [ -f "$cand/include/cuda_runtime_api.h" ]; then export CUDA_HOME=$cand; break; fi
  done
fi
[ -n "${CUDA_HOME:-}" ] && export PATH="$CUDA_HOME/bin:$PATH"

step env 60 '
rc=0
nvidia-smi -L || rc=1
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader || rc=1
command -v nvcc && nvcc --version | tail -2
echo "CUDA_HOME=${CUDA_HOME:-unset}  python=$(command -v $PY)  $($PY --version 2>&1)"
$PY -c "import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"available\", torch.cuda.is_available())" || rc=1
exit $rc
'

step deps 120 '
set -e
pip_() { if [ -n "${GPU_CHECK_NO_PIP:-}" ]; then echo "(GPU_CHECK_NO_PIP: skipped pip install $*)"; else $PY -m pip install "$@"; fi; }
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "torch is missing or sees no GPU: trying pip install torch==2.13.0 (PyPI Linux wheels are CUDA builds)"
  pip_ '"${PIP_FAST[*]}"' torch==2.13.0 || echo "pip install torch failed (offline?)"
fi
missing=""
for pair in psutil:psutil yaml:pyyaml pynvml:nvidia-ml-py ninja:ninja pytest:pytest; do
  mod=${pair%%:*}; pkg=${pair##*:}
  $PY -c "import $mod" 2>/dev/null || missing="$missing $pkg"
done
if [ -n "$missing" ]; then
  echo "installing:$missing"
  pip_ '"${PIP_FAST[*]}"' $missing || echo "pip install$missing failed (offline?)"
fi
pip_ '"${PIP_FAST[*]}"' --no-deps --no-build-isolation -e . 2>&1 | tail -3 || true
$PY -c "import torch, fp4offload, pytest, ninja; assert torch.cuda.is_available(), \"torch sees no GPU\"; print(\"fp4offload from\", fp4offload.__file__)"
'

step build 300 '
$PY - <<"EOF"
import json, time, torch
from fp4offload.ops import cuda
t = time.time()
cuda.extension()
dt = time.time() - t
cap = torch.cuda.get_device_capability()
print(json.dumps({"step": "build", "seconds": round(dt, 1), "device": torch.cuda.get_device_name(),
                  "capability": f"{cap[0]}.{cap[1]}", "flags": cuda.nvcc_flags(),
                  "hardware_e2m1": cuda.hardware_e2m1()}))
EOF
'

step compile 150 '$PY -m pytest tests/test_cuda_compile.py -q -p no:cacheprovider -m "not slow" -o addopts=""'

step gpu 300 '$PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else \"no CUDA device: the gpu tests would only skip\")" &&
  $PY -m pytest -m gpu -q -rfE -p no:cacheprovider -o addopts="" --continue-on-collection-errors --maxfail=25'

step speed 90 '
$PY - <<"EOF"
import json, torch
from fp4offload.ops import cuda

def timed(fn, reps=10):
    fn(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) / reps / 1e3

n = 1 << 28
ext = cuda.extension()
for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(n, device="cuda", dtype=dtype)
    es = x.element_size()
    cases = {
        "nvfp4-1x16": (lambda: ext.nvfp4_encode(x, 1, n, 1, 0, False, False, 0, 0, False, None), 0.5625),
        "nvfp4-1x16-sr": (lambda: ext.nvfp4_encode(x, 1, n, 1, 0, False, True, 1, 0, False, None), 0.5625),
        "nvfp4-16x16": (lambda: ext.nvfp4_encode(x, 1 << 14, 1 << 14, 16, 0, False, False, 0, 0, False, None), 0.5039),
        "mxfp4": (lambda: ext.mx_encode(x, False, False, False, 0, 0, False), 0.53125),
        "mxfp8": (lambda: ext.mx_encode(x, True, False, False, 0, 0, False), 1.03125),
    }
    for name, (fn, out_b) in cases.items():
        s = timed(fn)
        passes = 1 if name.startswith("mx") else 2  # NVFP4 reads x twice (amax, then encode)
        print(json.dumps({"op": "encode", "fmt": name, "dtype": str(dtype), "n": n, "ms": round(s * 1e3, 3),
                          "src_GB_per_s": round(n * es / s / 1e9, 1),
                          "moved_GB_per_s": round(n * (passes * es + out_b) / s / 1e9, 1)}))
    d, sc, ts, _ = ext.nvfp4_encode(x, 1, n, 1, 0, False, False, 0, 0, False, None)
    s = timed(lambda: ext.nvfp4_decode(d, sc, ts, 1, n, 1, 0, False, dtype))
    print(json.dumps({"op": "decode", "fmt": "nvfp4-1x16", "dtype": str(dtype), "n": n, "ms": round(s * 1e3, 3),
                      "out_GB_per_s": round(n * es / s / 1e9, 1),
                      "moved_GB_per_s": round(n * (es + 0.5625) / s / 1e9, 1)}))
    s = timed(lambda: x.clone())
    print(json.dumps({"op": "copy", "dtype": str(dtype), "n": n, "ms": round(s * 1e3, 3),
                      "moved_GB_per_s": round(n * 2 * es / s / 1e9, 1)}))
    del x, d, sc, ts
    torch.cuda.empty_cache()
EOF
'

if [ -f benchmarks/codec.py ]; then
  step bench:codec 120 '$PY -m benchmarks.codec --device cuda --json'
fi
for f in benchmarks/*.py; do
  base=$(basename "$f" .py)
  case "$base" in __init__|harness|codec) continue ;; esac
  if grep -q -- "--device" "$f"; then
    step "bench:$base" 90 "\$PY -m benchmarks.$base --device cuda --json"
  fi
done

echo
echo "=== summary (total $(elapsed)s)"
printf '%-16s %-16s %8s\n' step status seconds
failed=0
for i in "${!STEP_NAMES[@]}"; do
  printf '%-16s %-16s %8s\n' "${STEP_NAMES[$i]}" "${STEP_STATUS[$i]}" "${STEP_SECS[$i]}"
  [ "${STEP_STATUS[$i]}" = PASS ] || failed=1
done
if [ -n "$TEE_PID" ]; then  # let tee write the last lines of the log before the machine is read back
  exec 1>&- 2>&-
  wait "$TEE_PID" 2>/dev/null || sleep 1
fi
exit $failed
