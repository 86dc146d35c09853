#!/usr/bin/env bash
# Entry point of the geotrain image: `docker run IMAGE peer ...` runs `geotrain peer ...`.
#
# GEOTRAIN_INITIAL_PEERS_FILE lets a trainer start before anyone knows the coordinator's peer id (a
# compose stack, a Kubernetes pod): the trainer waits until the file, which `geotrain coordinator
# --initial-peers-file` writes into a shared volume, has appeared, and passes each address in it as
# --initial-peers. GEOTRAIN_INITIAL_PEERS_WAIT_S bounds the wait (default 300 s).
#
# A trainer or coordinator whose /dev/shm is under 1 GB gets a warning: hivemind keeps gradients and
# offloaded parameters there, and a full /dev/shm shows up much later as a bus error or "No space left on
# device" deep inside torch. Docker's default is 64 MB; run with --shm-size 10g or --ipc=host.
set -euo pipefail

readonly EXIT_SWARM_JOIN_FAILED=3   # geotrain's own code for "could not join"
readonly SHM_WARN_BELOW_KB=$((1024 * 1024))
args=("$@")
if [[ ${1:-} == peer || ${1:-} == coordinator ]]; then
    shm_kb=""
    # df -P: a header line, then "FILESYSTEM 1024-BLOCKS USED AVAILABLE CAPACITY MOUNTED-ON"
    { read -r _ && read -r _ shm_kb _; } < <(df -Pk /dev/shm 2>/dev/null) || true
    if [[ $shm_kb =~ ^[0-9]+$ ]] && ((shm_kb < SHM_WARN_BELOW_KB)); then
        echo "geotrain-entrypoint: /dev/shm holds only $((shm_kb / 1024)) MB, and hivemind keeps gradients and" \
            "parameters there; run the container with --shm-size 10g (compose: shm_size) or --ipc=host" >&2
    fi
fi
if [[ ${1:-} == peer && -n ${GEOTRAIN_INITIAL_PEERS_FILE:-} ]]; then
    file=$GEOTRAIN_INITIAL_PEERS_FILE
    wait_s=${GEOTRAIN_INITIAL_PEERS_WAIT_S:-300}
    waited_s=0
    # The coordinator renames a finished file into place, so a non-empty file is a complete one.
    until [[ -s $file ]]; do
        if ((waited_s >= wait_s)); then
            echo "geotrain-entrypoint: $file did not appear within $wait_s s; is the coordinator running with" \
                "--initial-peers-file $file on a volume shared with this container?" >&2
            exit "$EXIT_SWARM_JOIN_FAILED"
        fi
        sleep 1
        waited_s=$((waited_s + 1))
    done
    while read -r address; do
        if [[ -n $address ]]; then
            args+=(--initial-peers "$address")
        fi
    done <"$file"
fi
exec "${GEOTRAIN_BIN:-geotrain}" "${args[@]}"
