#!/usr/bin/env bash
# The operations CLI on the fs tier root that examples/asyncio_server.py filled:
#
#   python examples/asyncio_server.py --requests 60    # fills ./kvtier-example-root
#   examples/inspect_and_gc.sh [ROOT]
#
# It reports what the root holds, reads and checks every block, shows what a GC down to 4 MiB
# would delete (least recently used first, as the fs tier's own max_bytes does), does it, and
# lists the CPU tier's shared regions in /dev/shm. The same commands take s3://BUCKET/PREFIX
# with --endpoint, credentials from the AWS chain (AWS_ACCESS_KEY_ID, AWS_PROFILE...).
#
# Runs `kvtier`, or `python3 -m kvtier_async.cli` where that is not on PATH; KVTIER overrides
# both (KVTIER="python -m kvtier_async.cli").
set -euo pipefail
root=${1:-kvtier-example-root}
if [[ ! -d $root ]]; then
    echo "$0: $root: no such directory; fill it first:" \
        "python examples/asyncio_server.py --requests 60" >&2
    exit 2
fi
if [[ -n ${KVTIER:-} ]]; then
    read -r -a kvtier <<<"$KVTIER"
elif command -v kvtier >/dev/null; then
    kvtier=(kvtier)
else
    kvtier=(python3 -m kvtier_async.cli)
fi

step() {
    printf '\n$ kvtier %s\n' "$*"
    "${kvtier[@]}" "$@"
}

step inspect "$root"
step inspect --verify "$root"
step gc "$root" --max-bytes 4M --dry-run
step gc "$root" --max-bytes 4M
step inspect --json "$root"
step regions
