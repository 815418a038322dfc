# source me on the device machine (after scripts/gpu/device_setup.sh ran on it)
export PYTHONPATH=/tmp/site:/tmp/lmc-py:$PWD HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
       PYTHONUNBUFFERED=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 TOKENIZERS_PARALLELISM=false
