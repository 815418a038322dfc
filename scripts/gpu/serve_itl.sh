#!/bin/bash
# Device machine, repository root, after scripts/gpu/device_setup.sh: vLLM's own serving
# benchmark against `vllm serve`, vLLM alone and with the connector (SnapKV 0.25 packed in
# place, every other option at its default: cuda_graphs "auto"), then `lmcompact bench itl`
# on the connector's step trace: docs/benchmarks/serve-itl-<card>.{json,png} (h100 or h200).
# Needs a tokenizer in $TOK (any Llama-style tokenizer.json whose ids fit the vocabulary:
# SmolLM2's) and aiohttp for the client on $AIO (both are carried in .vcarry).
#   bash scripts/gpu/serve_itl.sh            # 24 x (16k + 1024), pool of 6 full requests
set -uo pipefail
source scripts/gpu/device_env.sh
unset VLLM_ENABLE_V1_MULTIPROCESSING  # the server's engine core runs in its own process
OUT=${OUT:-/tmp/out}
TOK=${TOK:-/tmp/lmc-tok}
AIO=${AIO:-/tmp/lmc-aio}
N=${N:-24}
P=${P:-16384}
O=${O:-1024}
POOL=$((6 * ((P + O + 31) / 32) + 1))  # 6 full requests, block 32, plus vLLM's null block
PORT=8011
mkdir -p "$OUT"
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oiE 'h100|h200' | tr A-Z a-z)
MODEL=$(python3 -c "from pathlib import Path; from lmcompact.bench.serve import shape_folder; print(shape_folder('llama3-8b', Path('/tmp/shapes')))")
cp "$TOK"/tokenizer*.json "$MODEL"/
EXTRA='{"policy": "snapkv", "budget": 0.25, "store": false, "release": {"prefill": "pack"}, "step_trace": "'$OUT'/steps.jsonl"}'
TRANSFER='{"kv_connector": "LMCompactConnector", "kv_connector_module_path": "connectors.vllm.connector", "kv_role": "kv_both", "kv_connector_extra_config": '$EXTRA'}'

one_run() {  # name, then extra `vllm serve` arguments
  local name=$1
  shift
  python3 -m connectors.vllm.launcher serve "$MODEL" --load-format dummy --dtype bfloat16 \
    --block-size 32 --max-model-len $((P + O + 64)) --num-gpu-blocks-override $POOL \
    --port $PORT "$@" > "$OUT/serve-$name.log" 2>&1 &
  local pid=$!
  local began=$SECONDS
  until curl -sf "localhost:$PORT/health" > /dev/null; do
    if ! kill -0 $pid 2> /dev/null || ((SECONDS - began > 400)); then
      echo "server $name did not start"; tail -30 "$OUT/serve-$name.log"; return 1
    fi
    sleep 2
  done
  echo "server $name up after $((SECONDS - began)) s"
  PYTHONPATH=$AIO:$PYTHONPATH python3 -m vllm.entrypoints.cli.main bench serve --backend vllm \
    --model "$MODEL" --tokenizer "$MODEL" --dataset-name random --random-input-len $P \
    --random-output-len $O --num-prompts $N --request-rate inf --ignore-eos --num-warmups 0 \
    --port $PORT --percentile-metrics ttft,tpot,itl --metric-percentiles 50,99 \
    --save-result --save-detailed --result-dir "$OUT" --result-filename "bench-$name.json" \
    > "$OUT/bench-$name.log" 2>&1
  tail -25 "$OUT/bench-$name.log"
  kill -INT $pid
  wait $pid
}

one_run vllm
one_run lmcompact --kv-transfer-config "$TRANSFER"
grep -E "cuda_graphs|compacted .* in place" "$OUT/serve-lmcompact.log" | head -3
python3 -m lmcompact bench itl --result "$OUT/bench-lmcompact.json" \
  --baseline "$OUT/bench-vllm.json" --trace "$OUT/steps.jsonl" \
  --json "$OUT/serve-itl-${CARD:-gpu}.json" --plot "$OUT/serve-itl-${CARD:-gpu}.png"
# the device hands back a few files per call: the server logs and step traces travel as one
tar czf "$OUT/serve-itl-${CARD:-gpu}-logs.tgz" -C "$OUT" serve-vllm.log serve-lmcompact.log \
  steps.jsonl steps.jsonl.rank0 && rm -f "$OUT"/serve-*.log "$OUT"/steps.jsonl*
