#!/bin/bash
# Device machine (nvidia-h200), repository root, after scripts/gpu/device_setup.sh: the per-head
# figures of docs/benchmarks/perhead-h200.md. One stage per call (each fits the 10-minute
# limit); results and logs go to $OUT.
#   bash scripts/gpu/perhead_h200.sh tests      # kernels, device tables, vLLM under full graphs
#   bash scripts/gpu/perhead_h200.sh connector  # bench connector, 16k, 8B shape, 4 configurations
#   bash scripts/gpu/perhead_h200.sh serve      # bench serve 24 x (16k + 1024), Ada-KV vs SnapKV
set -uo pipefail
source scripts/gpu/device_env.sh
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
KVZIP='"policy": "kvzip", "budget": 0.25, "window": 64, "cuda_graphs": "full", "release": {"prefill": "off"}'
case "$1" in
tests)
  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels.py -k "entry or dense" \
    tests/gpu/test_connector_perhead.py 2>&1 | tail -15 | tee "$OUT/perhead-kernels.log"
  timeout 420 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_serve_graphs.py \
    -k "per_head or packs" > "$OUT/perhead-serve-graphs.log" 2>&1
  grep -E "max \||passed|failed|Error" "$OUT/perhead-serve-graphs.log" | tail -20
  ;;
connector)
  python3 -m lmcompact bench connector --shape llama3-8b --prompt-tokens 16384 \
    --decode-tokens 64 --configs "{
 \"kvzip_head\": {$KVZIP, \"policy_params\": {\"allocation\": \"head\", \"share\": false, \"kernel_size\": 1}, \"store\": {\"compact_on\": \"save\"}},
 \"kvzip_ragged\": {$KVZIP, \"policy_params\": {\"allocation\": \"ragged\", \"share\": false, \"kernel_size\": 1}, \"store\": {\"compact_on\": \"save\", \"per_head\": {\"slack\": 3}}},
 \"snapkv_inplace\": {\"policy\": \"snapkv\", \"budget\": 0.25, \"window\": 64, \"cuda_graphs\": \"full\", \"store\": false, \"release\": {\"prefill\": \"pack\"}},
 \"adakv_inplace\": {\"policy\": \"adakv\", \"budget\": 0.25, \"window\": 64, \"cuda_graphs\": \"full\", \"store\": false, \"release\": {\"prefill\": \"pack\", \"per_head\": {\"slack\": 1.5}}}}" \
    --json "$OUT/perhead-h200-bench.json" > "$OUT/perhead-bench.log" 2>&1; tail -30 "$OUT/perhead-bench.log"
  ;;
serve)
  python3 -m lmcompact bench serve --shape llama3-8b --prompt-tokens 16384 --output-tokens 1024 \
    --requests 24 --pool-requests 6 --budgets 0.25 --cuda-graphs full --per-head-policy adakv \
    --json "$OUT/perhead-serve-h200.json" 2>&1 | tail -30
  ;;
*) echo "stage: tests | connector | serve"; exit 2 ;;
esac
