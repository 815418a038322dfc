#!/bin/bash
# Device machine (nvidia-h200), repository root, after scripts/gpu/device_setup.sh: the per-head
# figures of docs/benchmarks/perhead-h200.md. One stage per call (each fits the 10-minute
# limit); results and logs go to $OUT.
#   bash scripts/gpu/perhead_h200.sh tests      # kernels, device tables, vLLM under full graphs
#   bash scripts/gpu/perhead_h200.sh plans      # window-scored plans on CUDA = on the host;
#                                               #   the window-score kernel's warm-up (~1 min)
#   bash scripts/gpu/perhead_h200.sh connector-store    # bench connector, 16k, 8B shape: kvzip
#   bash scripts/gpu/perhead_h200.sh connector-inplace  #   head vs ragged; SnapKV vs Ada-KV packs
#   bash scripts/gpu/perhead_h200.sh inplace-default    # SnapKV vs Ada-KV packs + the default hit
#   bash scripts/gpu/perhead_h200.sh pairs      # kvzip head/ragged/ragged int8, SnapKV/Ada-KV
#   bash scripts/gpu/perhead_h200.sh serve      # bench serve 24 x (16k + 1024), Ada-KV vs SnapKV
#   bash scripts/gpu/perhead_h200.sh profile    # one hit of each kind under cProfile: kvzip
#                                               #   head and ragged, Ada-KV in place
#   bash scripts/gpu/perhead_h200.sh micro      # the per-head decode launch vs FlashAttention
set -uo pipefail
source scripts/gpu/device_env.sh
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
KVZIP='"policy": "kvzip", "budget": 0.25, "window": 64, "cuda_graphs": "full", "release": {"prefill": "off"}'
case "$1" in
tests)
  # -k applies to every file given: the connector and store files run without it
  { python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels.py -k "entry or dense"
    python3 -m pytest -q -p no:cacheprovider tests/gpu/test_device_pack.py -k per_head
    python3 -m pytest -q -p no:cacheprovider tests/gpu/test_connector_perhead.py \
      tests/gpu/test_store_quant.py tests/gpu/test_host_copies.py; } 2>&1 | grep -E "passed|failed|Error" \
    | tee "$OUT/perhead-kernels.log"
  timeout 420 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_serve_graphs.py \
    -k "per_head or packs" > "$OUT/perhead-serve-graphs.log" 2>&1
  grep -E "max \||passed|failed|Error" "$OUT/perhead-serve-graphs.log" | tail -20
  ;;
plans)
  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_device_pack.py \
    -k "window_scored or warm_up" 2>&1 | tail -15 | tee "$OUT/perhead-plans.log"
  ;;
connector-store)  # the stored-prefix pair (one run: ~4 min on the H100)
  python3 -m lmcompact bench connector --shape llama3-8b --prompt-tokens 16384 \
    --decode-tokens 64 --configs "{
 \"kvzip_head\": {$KVZIP, \"policy_params\": {\"allocation\": \"head\", \"share\": false, \"kernel_size\": 1}, \"store\": {\"compact_on\": \"save\"}},
 \"kvzip_ragged\": {$KVZIP, \"policy_params\": {\"allocation\": \"ragged\", \"share\": false, \"kernel_size\": 1}, \"store\": {\"compact_on\": \"save\", \"per_head\": {\"slack\": 3}}}}" \
    --json "$OUT/perhead-h200-bench-store.json" > "$OUT/perhead-bench-store.log" 2>&1
  tail -30 "$OUT/perhead-bench-store.log"
  ;;
connector-inplace)  # the in-place pair (one run)
  python3 -m lmcompact bench connector --shape llama3-8b --prompt-tokens 16384 \
    --decode-tokens 64 --configs "{
 \"snapkv_inplace\": {\"policy\": \"snapkv\", \"budget\": 0.25, \"window\": 64, \"cuda_graphs\": \"full\", \"store\": false, \"release\": {\"prefill\": \"pack\"}},
 \"adakv_inplace\": {\"policy\": \"adakv\", \"budget\": 0.25, \"window\": 64, \"cuda_graphs\": \"full\", \"store\": false, \"release\": {\"prefill\": \"pack\", \"per_head\": {\"slack\": 1.5}}}}" \
    --json "$OUT/perhead-h200-bench-inplace.json" > "$OUT/perhead-bench-inplace.log" 2>&1
  tail -30 "$OUT/perhead-bench-inplace.log"
  ;;
inplace-default)  # the in-place pair and the default store's hit, one run
  python3 -m lmcompact bench connector --shape llama3-8b --prompt-tokens 16384 \
    --decode-tokens 64 --configs "{
 \"snapkv_inplace\": {\"policy\": \"snapkv\", \"budget\": 0.25, \"window\": 64, \"cuda_graphs\": \"full\", \"store\": false, \"release\": {\"prefill\": \"pack\"}},
 \"adakv_inplace\": {\"policy\": \"adakv\", \"budget\": 0.25, \"window\": 64, \"cuda_graphs\": \"full\", \"store\": false, \"release\": {\"prefill\": \"pack\", \"per_head\": {\"slack\": 1.5}}},
 \"default\": {\"budget\": 0.25}}" \
    --json "$OUT/perhead-h200-bench-inplace-default.json" > "$OUT/perhead-bench-inplace-default.log" 2>&1
  tail -30 "$OUT/perhead-bench-inplace-default.log"
  ;;
pairs)  # every per-head row beside its uniform row, one run: the figures of perhead-h200.json
  python3 -m lmcompact bench connector --shape llama3-8b --prompt-tokens 16384 \
    --decode-tokens 64 --configs "{
 \"kvzip_head\": {$KVZIP, \"policy_params\": {\"allocation\": \"head\", \"share\": false, \"kernel_size\": 1}, \"store\": {\"compact_on\": \"save\"}},
 \"kvzip_ragged\": {$KVZIP, \"policy_params\": {\"allocation\": \"ragged\", \"share\": false, \"kernel_size\": 1}, \"store\": {\"compact_on\": \"save\", \"per_head\": {\"slack\": 3}}},
 \"kvzip_ragged_int8\": {$KVZIP, \"policy_params\": {\"allocation\": \"ragged\", \"share\": false, \"kernel_size\": 1}, \"store\": {\"compact_on\": \"save\", \"per_head\": {\"slack\": 3}, \"quantize\": \"int8\"}},
 \"snapkv_inplace\": {\"policy\": \"snapkv\", \"budget\": 0.25, \"window\": 64, \"cuda_graphs\": \"full\", \"store\": false, \"release\": {\"prefill\": \"pack\"}},
 \"adakv_inplace\": {\"policy\": \"adakv\", \"budget\": 0.25, \"window\": 64, \"cuda_graphs\": \"full\", \"store\": false, \"release\": {\"prefill\": \"pack\", \"per_head\": {\"slack\": 1.5}}}}" \
    --json "$OUT/perhead-h200-bench-pairs.json" > "$OUT/perhead-bench-pairs.log" 2>&1
  tail -30 "$OUT/perhead-bench-pairs.log"
  ;;
profile)  # where a hit's time goes (the host functions with the most cumulative time)
  python3 -m lmcompact bench connector --shape llama3-8b --prompt-tokens 16384 \
    --decode-tokens 64 --profile --configs "{
 \"kvzip_head\": {$KVZIP, \"policy_params\": {\"allocation\": \"head\", \"share\": false, \"kernel_size\": 1}, \"store\": {\"compact_on\": \"save\"}},
 \"kvzip_ragged\": {$KVZIP, \"policy_params\": {\"allocation\": \"ragged\", \"share\": false, \"kernel_size\": 1}, \"store\": {\"compact_on\": \"save\", \"per_head\": {\"slack\": 3}}},
 \"adakv_inplace\": {\"policy\": \"adakv\", \"budget\": 0.25, \"window\": 64, \"cuda_graphs\": \"full\", \"store\": false, \"release\": {\"prefill\": \"pack\", \"per_head\": {\"slack\": 1.5}}}}" \
    --json "$OUT/perhead-h200-bench-profile.json" > "$OUT/perhead-bench-profile.log" 2>&1
  tail -30 "$OUT/perhead-bench-profile.log"
  ;;
micro)  # per-layer times of the per-head decode launch (scripts/gpu/entry_decode_micro.py)
  python3 scripts/gpu/entry_decode_micro.py --json "$OUT/entry-decode-micro.json" 2>&1 | tail -30
  ;;
serve)
  python3 -m lmcompact bench serve --shape llama3-8b --prompt-tokens 16384 --output-tokens 1024 \
    --requests 24 --pool-requests 6 --budgets 0.25 --cuda-graphs full --per-head-policy adakv \
    --json "$OUT/perhead-serve-h200.json" 2>&1 | tail -30
  ;;
*) echo "stage: tests | plans | pairs | connector-store | connector-inplace | inplace-default | profile | micro | serve"; exit 2 ;;
esac
