#!/usr/bin/env bash
# Issue 28's device checks, as one script a session with a lent GPU runs from the repo's root
# (after ../shared/device/prepare.sh and the carry calls it describes; see bench/README.md):
#   source .device/unpack.sh && bash bench/device_check.sh
# Each step's output goes to $OUT (or ./device-out): the gpu tests, issue 28's benchmark with
# CUDA graphs off and on, a graphs-on kvmuxd soak of 1,024 items, a real allocator refusal.
set -uo pipefail
out=${OUT:-device-out}
mkdir -p "$out"
export KVMUX_MODEL_CACHE=${KVMUX_MODEL_CACHE:-/tmp/kvmux-models} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
status=0
step() {  # name, then the command
  local name=$1
  shift
  echo "== $name: $*" | tee -a "$out/summary.txt"
  local t0=$SECONDS
  "$@" >"$out/$name.txt" 2>&1
  local rc=$?
  tail -n 25 "$out/$name.txt"
  echo "== $name: exit $rc in $((SECONDS - t0)) s" | tee -a "$out/summary.txt"
  [ $rc -eq 0 ] || status=1
}
step gpu-tests timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/engine/test_device_cohorts.py \
  tests/kv/test_cuda_storage.py tests/engine/test_structured.py
step busy timeout 240 python3 -m bench.bench_busy --provider cuda --model small --dtype float16 \
  --graphs both --sizes 1,16,64,256 --repeats 2
step soak timeout 120 python3 -m bench.device_checks soak --items 1024
step refusal timeout 100 python3 -m bench.device_checks refusal
exit $status
