#!/usr/bin/env bash
# Entry point of the geotrain image: `docker run IMAGE peer ...` runs `geotrain peer ...`.
#
# GEOTRAIN_INITIAL_PEERS_FILE lets a trainer start before anyone knows the coordinator's peer id (a
# compose stack, a Kubernetes pod): the trainer waits until the file, which `geotrain coordinator
# --initial-peers-file` writes into a shared volume, has appeared, and passes each address in it as
# --initial-peers. GEOTRAIN_INITIAL_PEERS_WAIT_S bounds the wait (default 300 s).
set -euo pipefail

readonly EXIT_SWARM_JOIN_FAILED=3   # geotrain's own code for "could not join"
args=("$@")
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
