#!/usr/bin/env bash
# On the device machine, after `stage.py receive --stack d` installed every part: the tests on stack D
# (vLLM's CPU build) on the device's host CPU, e.g. DeepSeek-V4 where the CPU has AMX tiles:
#   bash scripts/gpu-engine/stack-d.sh tests/engine/test_engine_dsv4.py     (pytest arguments)
set -euo pipefail
cd "$(dirname "$0")/../.."
python=/tmp/gpu-engine/d/python
[ -x "$python/bin/python3.11" ] || { echo "stack-d.sh: no $python; carry every .gpu-stage/d/part-K through 'stage.py receive --stack d' first" >&2; exit 2; }
export LD_LIBRARY_PATH="$python/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"   # the interpreter was built elsewhere
export LMCACHE_ASCEND_AUTOLOAD=0 LMCACHE_LOG_LEVEL=${LMCACHE_LOG_LEVEL:-WARNING} VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}
"$python/bin/python3.11" -c 'import platform, torch; print("host:", platform.processor() or platform.machine(), "| AMX tiles:", torch.cpu._is_amx_tile_supported(), "| torch", torch.__version__)'
exec "$python/bin/python3.11" -m pytest -q -s -p no:cacheprovider "$@"
