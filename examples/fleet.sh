#!/usr/bin/env bash
# A fleet on one machine: two `vllm serve` engines with the kvtier connector on one shared fs
# root and one S3 bucket (rclone serve s3), and the fleet router with its prefix index in
# front. The recipe ships with the package (`kvtier fleet recipe` prints its path); its
# header lists the settings. For example, on a CPU-only machine with vLLM's CPU build:
#
#   kvtier tiny-model ./tiny
#   MODEL=./tiny examples/fleet.sh up      # then: curl 127.0.0.1:8000/v1/completions ...
#   examples/fleet.sh status
#   examples/fleet.sh down
set -euo pipefail
recipe=$(kvtier fleet recipe)
exec bash "$recipe" "$@"
