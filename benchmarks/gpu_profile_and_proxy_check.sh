#!/usr/bin/env bash
# The one prepared device check (issue #7, item 4), about 5 min on one GPU (166 s without the depth
# set): the operator profile
# (`python -m service profile`, bf16 GEMMs over llama2-13b's shapes, flash attention fwd/bwd, HBM
# bandwidth, per-kernel overhead, host AdamW) and `benchmarks/gpu_proxy_check.py` (13B-width proxies,
# measured vs predicted), in one call. Everything lands in $OUT (default benchmarks/results/), to be
# committed into benchmarks/results/:
#   gpu_profile.yaml            the profile (load_profile reads it; calibration takes it in)
#   gpu_profile.json            the same as `--json` printed it
#   <catalog-gpu>-profiled.yaml a catalog entry: the detected GPU's entry with the measured fields
#   gpu_proxy_check.json        the proxy check's results (or gpu_proxy_check.skipped: why not)
#   gpu_proxy_depth.json        the same loop over 1-8 layers (`--set depth`)
#   gpu_clocks.csv              SM clock, power and temperature once a second while the profile runs
#                               (nvidia-smi): whether this part holds its clock under GEMM load at its
#                               power limit, which the H100 / H200 question in benchmarks/README.md needs
#   gpu_profile_and_proxy_check.log
#
# On the device machine, from the repository root:
#   bash benchmarks/gpu_profile_and_proxy_check.sh
# Prerequisites there: torch, numpy, transformers, pyyaml, psutil (in the image); pydantic for the
# profile; deepspeed and hjson for the proxy check. Wheels carried in .whl/ (git-ignored; made with
# `pip download --no-deps` for pydantic, pydantic_core (cp311/312/313), annotated_types,
# typing_inspection, hjson, and `pip wheel --no-deps --no-build-isolation deepspeed==0.19.8`) are
# installed offline with --no-deps into /tmp/site first. Without CUDA the same script profiles the CPU with a
# short budget and records why the proxy check did not run, so it can be tried on any machine.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
LOG="$OUT/gpu_profile_and_proxy_check.log"
PY="${PYTHON:-python3}"  # the GPU image names its interpreter python3
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
started=$(date +%s)
{
  echo "== $(date -u +%FT%TZ) $(uname -m) python $($PY -c 'import sys; print(sys.version.split()[0])')"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  if [ -d .whl ]; then  # pure wheels plus the pydantic_core built for this python
    tag=$($PY -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
    wheels=$(ls .whl/*.whl | grep -v -- '-cp3' ; ls .whl/*-"$tag"-*.whl 2>/dev/null)
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels 2>&1 | tail -3
  fi
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
} 2>&1 | tee "$LOG"

if $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  device=cuda budget="${PROFILE_BUDGET_S:-100}" shapes=(--model "${PROFILE_MODEL:-llama2-13b}")
else  # a smoke test of this script: the tiny CPU proxy's shapes, no gloo processes
  device=cpu budget="${PROFILE_BUDGET_S:-20}" shapes=(--experiment experiments/tiny-cpu.yaml --workers 0)
fi
base=$($PY -c "from service.profile.profiler import catalog_gpu_for_device as c; print(c('$device'))")
entry="${base}-profiled"

echo "== profile: $device, ${shapes[*]}, budget ${budget}s, catalog entry $entry" | tee -a "$LOG"
clocks_pid=""
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=timestamp,name,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu \
    --format=csv -l 1 >"$OUT/gpu_clocks.csv" 2>>"$LOG" &
  clocks_pid=$!
fi
timeout $((budget + 90)) $PY -m service profile --device "$device" "${shapes[@]}" --budget-s "$budget" \
  --json --out "$OUT/gpu_profile.yaml" --write-catalog "$entry" >"$OUT/gpu_profile.json" 2>>"$LOG"
profile_rc=$?
[ -n "$clocks_pid" ] && kill "$clocks_pid" 2>/dev/null
if [ "$profile_rc" -eq 0 ]; then
  mv "service/catalog/gpus/$entry.yaml" "$OUT/$entry.yaml"  # the device copy of the repo is thrown away
  $PY - "$OUT/gpu_profile.yaml" <<'PY' 2>&1 | tee -a "$LOG"
import sys
from service.profile import load_profile
p = load_profile(sys.argv[1])
print(f"profile {p.device.name}: {p.wall_s:.0f} s; overrides for {p.base_gpu}: {p.gpu_overrides()}")
PY
else
  echo "profile failed (rc $profile_rc)" | tee -a "$LOG"
fi

echo "== gpu_proxy_check ($(( $(date +%s) - started )) s so far)" | tee -a "$LOG"
if [ "$device" != cuda ]; then
  echo "no CUDA GPU on $(hostname): gpu_proxy_check.py needs one" | tee "$OUT/gpu_proxy_check.skipped" | tee -a "$LOG"
elif ! $PY -c "import deepspeed" 2>/dev/null; then
  echo "deepspeed is not importable here (carry wheels in .whl/)" | tee "$OUT/gpu_proxy_check.skipped" | tee -a "$LOG"
else
  timeout "${PROXY_CHECK_TIMEOUT_S:-180}" $PY benchmarks/gpu_proxy_check.py --budget-s $(( ${PROXY_CHECK_TIMEOUT_S:-180} - 45 )) --out "$OUT/gpu_proxy_check.json" 2>&1 | tail -20 | tee -a "$LOG"
  # The depth set (1/2/4/8 layers, and 8 at micro-batch 2): per-layer and fixed step time, measured
  # against predicted (about 110 s on an H200). DEPTH_TIMEOUT_S=0 leaves it out.
  if [ "${DEPTH_TIMEOUT_S:-150}" -gt 0 ]; then
    echo "== gpu_proxy_check --set depth ($(( $(date +%s) - started )) s so far)" | tee -a "$LOG"
    timeout "${DEPTH_TIMEOUT_S:-150}" $PY benchmarks/gpu_proxy_check.py --set depth --steps 8 --budget-s $(( ${DEPTH_TIMEOUT_S:-150} - 40 )) --out "$OUT/gpu_proxy_depth.json" 2>&1 | tail -8 | tee -a "$LOG"
  fi
fi
echo "== done in $(( $(date +%s) - started )) s; files in $OUT" | tee -a "$LOG"
exit "$profile_rc"
