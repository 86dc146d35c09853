#!/usr/bin/env bash
# Start this VM's geotrain trainer or coordinator with the address and labels the cloud's metadata
# service reports. systemd runs it at every start of geotrain@trainer or geotrain@coordinator (see
# peers/systemd/geotrain@.service), not just once: a spot VM that comes back from a stop can have a
# new public address, and the peer must announce the new one.
#
#     peers/run.sh trainer|coordinator
#
# Settings come from the environment (under systemd: /etc/geotrain/geotrain.env, written by setup.sh):
#   GEOTRAIN_INITIAL_PEERS    trainer: the coordinator's /ip4/.../tcp/31337/p2p/... address (several:
#                             separated by spaces). Required for trainers.
#   GEOTRAIN_CLOUD            aws, gcp, azure, auto (ask each metadata service) or none. Default auto.
#   GEOTRAIN_RUN_ID, GEOTRAIN_CONFIG (a YAML file), GEOTRAIN_TASK, GEOTRAIN_PRESET,
#   GEOTRAIN_NETWORK_PROFILE  passed on as --run-id, --config, ... when set.
#   GEOTRAIN_EXTRA_ARGS       more flags for geotrain, split on spaces (no quoting).
#   GEOTRAIN_PORT             the DHT's TCP port (31337); open it between all peers.
#   GEOTRAIN_METRICS_PORT     Prometheus endpoint (9100); open it only to Prometheus.
#   GEOTRAIN_STATE_DIR        identity key and checkpoints (/var/lib/geotrain, on the boot disk, which
#                             survives a spot stop, so the peer id does too).
#   GEOTRAIN_ANNOUNCE_HOST, GEOTRAIN_REGION, GEOTRAIN_INSTANCE_TYPE   override what the metadata says.
#   GEOTRAIN_PREEMPTION       which preemption notices to watch (default: the VM's cloud; none for off).
#   GEOTRAIN_BIN              the geotrain executable (/opt/geotrain/venv/bin/geotrain).
#   GEOTRAIN_DRY_RUN=1        print what was found and the command, and start nothing.
#
# Exit status 2 means a setting is wrong (systemd does not restart on it, see the unit); 1 means the
# metadata service did not answer (systemd tries again).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=lib/discover.sh
source "$here/lib/discover.sh"

readonly EXIT_BAD_SETTING=2
role=${1:-trainer}
if [[ $role != trainer && $role != coordinator ]]; then
    geotrain_log "unknown role '$role'; expected trainer or coordinator"
    exit "$EXIT_BAD_SETTING"
fi

port=${GEOTRAIN_PORT:-31337}
metrics_port=${GEOTRAIN_METRICS_PORT:-9100}
state_dir=${GEOTRAIN_STATE_DIR:-/var/lib/geotrain}
geotrain=${GEOTRAIN_BIN:-/opt/geotrain/venv/bin/geotrain}
read -r -a initial_peers <<<"${GEOTRAIN_INITIAL_PEERS:-}"
read -r -a extra_args <<<"${GEOTRAIN_EXTRA_ARGS:-}"

if [[ $role == trainer ]]; then
    if ((${#initial_peers[@]} == 0)); then
        geotrain_log "GEOTRAIN_INITIAL_PEERS is empty; set it to the address 'geotrain coordinator' printed" \
            "(/ip4/PUBLIC_IP/tcp/31337/p2p/12D3KooW...)"
        exit "$EXIT_BAD_SETTING"
    fi
    for address in "${initial_peers[@]}"; do
        if [[ $address != /*/p2p/* ]]; then
            geotrain_log "GEOTRAIN_INITIAL_PEERS has '$address'; expected a full multiaddr like" \
                "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooW..., exactly as 'geotrain coordinator' prints it"
            exit "$EXIT_BAD_SETTING"
        fi
    done
fi

status=0
geotrain_discover "${GEOTRAIN_CLOUD:-auto}" || status=$?
if ((status != 0)); then
    exit "$status"
fi
announce_host=${GEOTRAIN_ANNOUNCE_HOST:-$GEOTRAIN_PUBLIC_IP}
if [[ -n $announce_host ]] && ! _geotrain_is_ipv4 "$announce_host"; then
    geotrain_log "GEOTRAIN_ANNOUNCE_HOST is '$announce_host'; expected an IPv4 address"
    exit "$EXIT_BAD_SETTING"
fi

# The trainer is `geotrain peer`; the coordinator `geotrain coordinator`.
if [[ $role == trainer ]]; then command=("$geotrain" peer); else command=("$geotrain" coordinator); fi
if [[ $role == coordinator ]]; then
    if [[ -z $announce_host ]]; then
        geotrain_log "this VM has no public IPv4 address, and trainers must dial the coordinator; attach one" \
            "or set GEOTRAIN_ANNOUNCE_HOST to an address the trainers can reach"
        exit "$EXIT_BAD_SETTING"
    fi
    # The coordinator keeps its identity and checkpoints in the state dir; the join address also lands
    # in a file there, for tools.
    command+=(--host 0.0.0.0 --port "$port" --announce-host "$announce_host"
        --state-dir "$state_dir" --initial-peers-file "$state_dir/initial-peers.txt")
else
    for address in "${initial_peers[@]}"; do
        command+=(--initial-peers "$address")
    done
    if [[ -n $announce_host ]]; then
        command+=(--host 0.0.0.0 --port "$port" --announce-host "$announce_host")
    else
        # Nobody can dial a VM without a public address, but it can still dial out and train.
        geotrain_log "no public IPv4 address (set GEOTRAIN_ANNOUNCE_HOST if there is one); joining in client mode"
        command+=(--client-mode)
    fi
    command+=(--identity "$state_dir/identity.key")
fi
command+=(--metrics-port "$metrics_port" --metrics-host 0.0.0.0
    --region "${GEOTRAIN_REGION:-unknown}" --cloud "$GEOTRAIN_CLOUD" --instance-type "${GEOTRAIN_INSTANCE_TYPE:-unknown}")
if [[ $role == trainer ]]; then
    # A spot VM gets a notice before it is taken away; the trainer leaves the swarm cleanly and exits 75.
    preemption=${GEOTRAIN_PREEMPTION:-$GEOTRAIN_CLOUD}
    command+=(--preemption "$preemption")
    if [[ -n ${GEOTRAIN_METADATA_URL:-} && $preemption =~ ^(aws|gcp|azure)$ ]]; then
        # the notices come from the same (moved) metadata service as everything above
        command+=(--set "preemption.${preemption}_metadata_url=$GEOTRAIN_METADATA_URL")
    fi
fi
[[ -z ${GEOTRAIN_RUN_ID:-} ]] || command+=(--run-id "$GEOTRAIN_RUN_ID")
[[ -z ${GEOTRAIN_CONFIG:-} ]] || command+=(--config "$GEOTRAIN_CONFIG")
# The coordinator builds the same model as the trainers (it keeps and checkpoints the swarm's state),
# so it takes the same task settings.
[[ -z ${GEOTRAIN_TASK:-} ]] || command+=(--task "$GEOTRAIN_TASK")
[[ -z ${GEOTRAIN_PRESET:-} ]] || command+=(--preset "$GEOTRAIN_PRESET")
[[ -z ${GEOTRAIN_NETWORK_PROFILE:-} ]] || command+=(--network-profile "$GEOTRAIN_NETWORK_PROFILE")
command+=("${extra_args[@]}")

if [[ ${GEOTRAIN_DRY_RUN:-0} == 1 ]]; then
    printf 'role=%s\ncloud=%s\nregion=%s\ninstance_type=%s\nannounce_host=%s\n' "$role" "$GEOTRAIN_CLOUD" \
        "${GEOTRAIN_REGION:-unknown}" "${GEOTRAIN_INSTANCE_TYPE:-unknown}" "$announce_host"
    printf 'command='
    printf '%q ' "${command[@]}"
    printf '\n'
    exit 0
fi
mkdir -p "$state_dir"
geotrain_log "starting the $role: ${command[*]}"
exec "${command[@]}"
