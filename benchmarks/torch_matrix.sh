#!/usr/bin/env bash
# torch_matrix.sh: run the FSDP2 and optimizer tests under each torch release users have, one virtual
# environment per release, kept outside the repository and reused by later runs.
#
#   bash benchmarks/torch_matrix.sh                          # 2.11.0, 2.13.0 and 2.14.1, in that order
#   bash benchmarks/torch_matrix.sh 2.13.0 2.14.1            # only these
#   bash benchmarks/torch_matrix.sh --out /tmp/m.json 2.13.0 # rows as JSON there (default /tmp/torch_matrix.json)
#
# Each release gets $TORCH_MATRIX_DIR/venv-<version> (default dir: $HOME/.cache/fp4offload/torch_matrix) made
# with $TORCH_MATRIX_PYTHON (default python3), in which it installs `torch==<version>` (whatever the configured
# pip index and find-links give: the local CPU wheel for 2.13.0, CUDA wheels, which also run on the CPU, for the
# others), the project's runtime dependencies and test extras at the versions CI uses, DeepSpeed when it
# installs (the subset does not need it), and the project itself with `pip install --no-build-isolation
# --no-deps -e .` (which writes only into that venv: the interpreter running this script is not touched). Each
# release gets its own $TORCH_MATRIX_DIR/ext-<version> as TORCH_EXTENSIONS_DIR, since a JIT extension built
# against one torch does not load in another.
#
# The subset (override with TORCH_MATRIX_TESTS, space separated): the FSDP2 integration files (training, masters,
# checkpoints, your own fully_shard with convert and HSDP, torch's checkpoint API, the Trainer) and every
# tests/unit file whose name mentions optim or fsdp, slow-marked (multi-rank) tests included, run with
# `pytest -p no:cacheprovider -q`, one release after another, on the CPU (DS_ACCELERATOR=cpu). Full logs go to
# $TORCH_MATRIX_DIR/log-<version>.txt. Printed: one markdown table row per release (torch version, passed,
# failed, skipped, errors, wall seconds, first failing test id). Exit status 1 when a release failed to
# install or had failing tests.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

OUT=/tmp/torch_matrix.json
VERSIONS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --out=*) OUT=${1#--out=}; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    -*) echo "unknown option $1" >&2; exit 2 ;;
    *) VERSIONS+=("$1"); shift ;;
  esac
done
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=(2.11.0 2.13.0 2.14.1)

BASE=${TORCH_MATRIX_DIR:-$HOME/.cache/fp4offload/torch_matrix}
PY=${TORCH_MATRIX_PYTHON:-python3}
case "$(realpath -m "$BASE")/" in
  "$ROOT"/*) echo "TORCH_MATRIX_DIR must lie outside the repository ($ROOT)" >&2; exit 2 ;;
esac
mkdir -p "$BASE"

# The versions CI's interpreter has (pyproject's ranges allow newer; pinned so that only torch differs).
DEPS=(psutil==7.2.2 nvidia-ml-py==13.615.71 pyyaml==6.0.3 ninja==1.13.2 safetensors==0.8.0
      pytest==9.0.3 pytest-xdist==3.8.0 transformers==5.25.0 accelerate==1.16.0)
DEEPSPEED=deepspeed==0.19.8

if [ -n "${TORCH_MATRIX_TESTS:-}" ]; then
  read -r -a TESTS <<<"$TORCH_MATRIX_TESTS"
else
  TESTS=(tests/integration/test_fsdp_train.py tests/integration/test_fsdp_master.py
         tests/integration/test_fsdp_checkpoint.py tests/integration/test_fsdp_torch_way.py
         tests/integration/test_fsdp_dcp.py tests/integration/test_fsdp_trainer.py)
  for f in tests/unit/test_*.py; do
    case "$(basename "$f")" in *optim*|*fsdp*) TESTS+=("$f") ;; esac
  done
fi

# setup VERSION VENV: make the venv (or reuse it) and install into it; returns 1 when torch or the project
# does not install.
setup() {
  local v=$1 venv=$2 pip
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv" || return 1
  pip=("$venv/bin/python" -m pip --disable-pip-version-check)
  local have
  have=$("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
  if [ "$have" != "$v" ]; then
    echo "[$v] installing torch==$v into $venv" >&2
    "${pip[@]}" install -q "torch==$v" || return 1
  fi
  if [ ! -f "$venv/.matrix-deps" ] || [ "$(cat "$venv/.matrix-deps")" != "${DEPS[*]}" ]; then
    echo "[$v] installing ${DEPS[*]}" >&2
    # torch==$v in the same request: nothing may move it.
    "${pip[@]}" install -q "torch==$v" "${DEPS[@]}" setuptools wheel || return 1
    echo "${DEPS[*]}" >"$venv/.matrix-deps"
  fi
  if ! "$venv/bin/python" -c 'import deepspeed' >/dev/null 2>&1 && [ ! -f "$venv/.matrix-no-deepspeed" ]; then
    echo "[$v] installing $DEEPSPEED (optional)" >&2
    if ! DS_BUILD_OPS=0 "${pip[@]}" install -q --no-build-isolation "torch==$v" "$DEEPSPEED" >&2; then
      echo "[$v] $DEEPSPEED does not install: skipped (the subset does not need it)" >&2
      touch "$venv/.matrix-no-deepspeed"
    fi
  fi
  # --no-deps: deepspeed, when it did not install, would otherwise be fetched again.
  "${pip[@]}" install -q --no-build-isolation --no-deps -e "$ROOT" >&2 || return 1
}

# summary LOG: "passed failed skipped errors first_failing_id" from pytest's -q output
summary() {
  "$PY" - "$1" <<'EOF'
import re, sys
text = open(sys.argv[1], errors="replace").read()
lines = [l for l in text.splitlines() if re.search(r"\d+ (passed|failed|error|skipped|deselected)", l)
         and " in " in l]
counts = {k: 0 for k in ("passed", "failed", "skipped", "error")}
if lines:
    for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", lines[-1]):
        counts["error" if k.startswith("error") else k] = int(n)
first = re.search(r"^(?:FAILED|ERROR) (\S+)", text, re.M)
print(counts["passed"], counts["failed"], counts["skipped"], counts["error"], first.group(1) if first else "-")
EOF
}

echo "| torch | passed | failed | skipped | errors | wall s | first failing test |"
echo "|---|---|---|---|---|---|---|"
ROWS=()
status=0
for v in "${VERSIONS[@]}"; do
  venv=$BASE/venv-$v
  log=$BASE/log-$v.txt
  if ! setup "$v" "$venv" >"$BASE/install-$v.txt" 2>&1; then
    echo "| $v | - | - | - | - | - | install failed: see $BASE/install-$v.txt |"
    ROWS+=("{\"torch\": \"$v\", \"install_failed\": true, \"log\": \"$BASE/install-$v.txt\"}")
    status=1
    continue
  fi
  tv=$("$venv/bin/python" -c 'import torch; print(torch.__version__)')
  mkdir -p "$BASE/ext-$v"
  t0=$(date +%s)
  rc=0
  env -u PYTHONPATH TORCH_EXTENSIONS_DIR="$BASE/ext-$v" DS_ACCELERATOR=cpu \
    "$venv/bin/python" -m pytest -p no:cacheprovider -q -rfE "${TESTS[@]}" >"$log" 2>&1 || rc=$?
  wall=$(( $(date +%s) - t0 ))
  read -r passed failed skipped errors first <<<"$(summary "$log")"
  # rc 1: tests failed; anything else (2-5, a signal) means pytest itself did not finish normally.
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 1 ] && [ "$first" = "-" ]; then first="pytest exit $rc: see $log"; fi
  [ "$rc" -eq 0 ] || status=1
  echo "| $tv | $passed | $failed | $skipped | $errors | $wall | $first |"
  ROWS+=("$("$PY" -c 'import json, sys; a = sys.argv[1:]; print(json.dumps({"torch": a[0], "passed": int(a[1]),
"failed": int(a[2]), "skipped": int(a[3]), "errors": int(a[4]), "wall_s": int(a[5]),
"first_failure": None if a[6] == "-" else a[6], "pytest_rc": int(a[7]), "log": a[8]}))' \
    "$tv" "$passed" "$failed" "$skipped" "$errors" "$wall" "$first" "$rc" "$log")")
done

{ echo "["; for i in "${!ROWS[@]}"; do
    sep=,; [ "$i" -eq $((${#ROWS[@]} - 1)) ] && sep=
    echo "  ${ROWS[$i]}$sep"
  done; echo "]"; } >"$OUT"
echo "rows written to $OUT" >&2
exit $status
