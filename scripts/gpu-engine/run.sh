#!/usr/bin/env bash
# On the device machine, after `stage.py receive` installed every part:
#   bash scripts/gpu-engine/run.sh [run.py options]      (results under $OUT, or /tmp/gpu-engine/out)
set -euo pipefail
cd "$(dirname "$0")/../.."
site=/tmp/gpu-engine/gpu/site
[ -d "$site/vllm" ] || { echo "run.sh: $site has no vLLM; carry every .gpu-stage/gpu/part-K through 'stage.py receive' first" >&2; exit 2; }
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# One engine process (vLLM's engine core in a process of its own does not start on this image);
# FlashInfer's sampler needs its JIT, which this image cannot build offline.
export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0
# The oracle and the reports reach the worker through collective_rpc as functions.
export VLLM_ALLOW_INSECURE_SERIALIZATION=1
export LMCACHE_CHUNK_SIZE=256 LMCACHE_LOCAL_CPU=True LMCACHE_MAX_LOCAL_CPU_SIZE=${LMCACHE_MAX_LOCAL_CPU_SIZE:-32}
export LMCACHE_LOG_LEVEL=${LMCACHE_LOG_LEVEL:-WARNING} VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}
exec python3 scripts/gpu-engine/run.py --out "${OUT:-/tmp/gpu-engine/out}" "$@"
