#!/usr/bin/env bash
# vLLM with kvtier-async's connector: GPU -> CPU -> local NVMe (vllm_fs.json), or
# GPU -> CPU -> NVMe and an S3-compatible store (vllm_s3.json).
#
#   examples/vllm_serve.sh [CONFIG.json] [MODEL]
#
# Needs vLLM 0.33 and kvtier-async installed in the same environment.
set -euo pipefail
config=${1:-"$(dirname "$0")/vllm_fs.json"}
model=${2:-meta-llama/Llama-3.1-8B-Instruct}

# S3 credentials come from the standard AWS chain (environment, AWS_PROFILE, instance role),
# never from the JSON: `vllm serve` logs kv_connector_extra_config among its arguments.
#   export AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=...
exec vllm serve "$model" --kv-transfer-config "$(cat "$config")"
