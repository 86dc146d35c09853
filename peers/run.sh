#!/usr/bin/env bash
# Start this VM's geotrain trainers (one per GPU) or its coordinator with the address and labels the
# cloud's metadata service reports. systemd runs it at every start of geotrain@trainer-N or
# geotrain@coordinator (see peers/systemd/geotrain@.service), not just once: a spot VM that comes back
# from a stop can have a new public address, and the peer must announce the new one.
#
#     peers/run.sh trainer|trainer-N|coordinator
#
# trainer-N starts the trainer of GPU N alone (what each systemd unit geotrain@trainer-N runs); trainer
# starts every trainer of this VM and stays in front of them (SkyPilot's run step; on a VM without GPUs or
# with one, it is the one trainer). A VM with G GPUs (the GPUs `nvidia-smi --list-gpus` lists) runs G
# trainers; trainer N computes on cuda:N, listens on GEOTRAIN_PORT + N, serves its metrics on
# GEOTRAIN_METRICS_PORT + N, keeps its peer id in STATE_DIR/identity-N.key and, when its data are
# WebDataset shards and no part is set, reads part N/G of them (--data-part). All announce the VM's address.
# A VM without a GPU (or without nvidia-smi) runs one trainer, on the CPU unless its config says otherwise.
#
# Settings come from the environment (under systemd: /etc/geotrain/geotrain.env, written by setup.sh):
#   GEOTRAIN_INITIAL_PEERS    trainer: the coordinator's /ip4/.../tcp/31337/p2p/... address (several:
#                             separated by spaces). Required for trainers.
#   GEOTRAIN_CLOUD            aws, gcp, azure, auto (ask each metadata service) or none. Default auto.
#   GEOTRAIN_RUN_ID, GEOTRAIN_CONFIG (a YAML file), GEOTRAIN_TASK, GEOTRAIN_PRESET,
#   GEOTRAIN_NETWORK_PROFILE  passed on as --run-id, --config, ... when set.
#   GEOTRAIN_EXTRA_ARGS       more flags for geotrain (every trainer), split on spaces (no quoting); they
#                             come last, so they win over the flags above (e.g. --device, --data-part).
#   GEOTRAIN_PORT             the DHT's TCP port (31337; trainer N: 31337 + N); open it between all peers.
#   GEOTRAIN_METRICS_PORT     Prometheus endpoint (9100; trainer N: 9100 + N); open it only to Prometheus.
#   GEOTRAIN_GPUS             how many GPUs to use, one trainer each (default: what nvidia-smi lists;
#                             0: one trainer, no --device).
#   GEOTRAIN_STATE_DIR        identity keys and checkpoints (/var/lib/geotrain, on the boot disk, which
#                             survives a spot stop, so the peer ids do too).
#   GEOTRAIN_ANNOUNCE_HOST, GEOTRAIN_REGION, GEOTRAIN_INSTANCE_TYPE   override what the metadata says.
#   GEOTRAIN_PREEMPTION       which preemption notices to watch (default: the VM's cloud; none for off).
#   GEOTRAIN_BIN              the geotrain executable (/opt/geotrain/venv/bin/geotrain).
#   GEOTRAIN_DRY_RUN=1        print what was found and the command of each peer, and start nothing.
#   GEOTRAIN_DRY_RUN_CONFIG   (dry runs of setup.sh) the file GEOTRAIN_CONFIG will be copied from, read in
#                             its place to see whether the data are WebDataset shards.
#
# Exit status 2 means a setting is wrong (systemd does not restart on it, see the unit); 1 means the
# metadata service did not answer (systemd tries again). With several trainers in front of it, run.sh
# exits with the status of the first one that failed (after stopping the others), else 0.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=lib/discover.sh
source "$here/lib/discover.sh"

readonly EXIT_BAD_SETTING=2
argument=${1:-trainer}
only=""   # trainer-N: the index N
case $argument in
    trainer | coordinator) role=$argument ;;
    trainer-*)
        role=trainer
        only=${argument#trainer-}
        if [[ ! $only =~ ^[0-9]+$ ]]; then
            geotrain_log "unknown role '$argument'; expected trainer, trainer-N (N: a GPU's index) or coordinator"
            exit "$EXIT_BAD_SETTING"
        fi
        only=$((10#$only))
        ;;
    *)
        geotrain_log "unknown role '$argument'; expected trainer, trainer-N (N: a GPU's index) or coordinator"
        exit "$EXIT_BAD_SETTING"
        ;;
esac

port=${GEOTRAIN_PORT:-31337}
metrics_port=${GEOTRAIN_METRICS_PORT:-9100}
state_dir=${GEOTRAIN_STATE_DIR:-/var/lib/geotrain}
geotrain=${GEOTRAIN_BIN:-/opt/geotrain/venv/bin/geotrain}
read -r -a initial_peers <<<"${GEOTRAIN_INITIAL_PEERS:-}"
read -r -a extra_args <<<"${GEOTRAIN_EXTRA_ARGS:-}"

for setting in GEOTRAIN_PORT GEOTRAIN_METRICS_PORT; do
    value=${!setting:-0}
    if [[ ! $value =~ ^[0-9]{1,5}$ ]] || ((10#$value > 65535)); then
        geotrain_log "$setting is '$value'; expected a TCP port"
        exit "$EXIT_BAD_SETTING"
    fi
done
port=$((10#$port))
metrics_port=$((10#$metrics_port))

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
    geotrain_count_gpus || exit "$EXIT_BAD_SETTING"
    gpus=$GEOTRAIN_GPUS
    trainers=$((gpus > 0 ? gpus : 1))
    if [[ -n $only ]] && ((only >= trainers)); then
        geotrain_log "there is no trainer $only: this VM has $gpus GPU(s) and so $trainers trainer(s), numbered from 0." \
            "Run the startup script (or peers/setup.sh) again, as GCE does at every boot, to start one geotrain@trainer-N per GPU"
        exit "$EXIT_BAD_SETTING"
    fi
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
if [[ $role == coordinator && -z $announce_host ]]; then
    geotrain_log "this VM has no public IPv4 address, and trainers must dial the coordinator; attach one" \
        "or set GEOTRAIN_ANNOUNCE_HOST to an address the trainers can reach"
    exit "$EXIT_BAD_SETTING"
fi

# data_settings: "SOURCE PART" of the trainers' data as geotrain resolves them (the config file, then
# --set task.data.KEY=..., then --data-source / --data-part in GEOTRAIN_EXTRA_ARGS); PART is - when unset.
# geotrain's own venv has PyYAML; elsewhere (a dry run on a laptop) python3 may, and without it the
# config file's data settings are not seen.
data_settings() {
    local config=${GEOTRAIN_DRY_RUN_CONFIG:-${GEOTRAIN_CONFIG:-}} python=${geotrain%/*}/python
    [[ -x $python ]] || python=python3
    "$python" - "$config" "${extra_args[@]}" <<'PYTHON'
import sys

config_path, *args = sys.argv[1:]
settings = {"source": None, "part": None}
if config_path:
    try:
        import yaml

        with open(config_path) as handle:
            document = yaml.safe_load(handle) or {}
        data = (document.get("task") or {}).get("data") or {}
        settings.update({key: data.get(key) for key in settings})
    except Exception as error:  # geotrain itself reports a config it cannot read, when it starts
        print(f"geotrain: could not read task.data from {config_path} ({type(error).__name__}: {error}); "
              "assuming it is not WebDataset shards", file=sys.stderr)
flags = {"--data-source": "source", "--data-part": "part"}
from_set, from_flags = {}, {}
index = 0
while index < len(args):
    name, equals, value = args[index].partition("=")
    if name == "--set" or name in flags:
        if not equals:
            index += 1
            value = args[index] if index < len(args) else ""
        if name == "--set":
            key, _, value = value.partition("=")
            if key.strip() in ("task.data.source", "task.data.part"):
                from_set[key.strip().rpartition(".")[2]] = value.strip() or None
        else:
            from_flags[flags[name]] = value
    index += 1
settings.update(from_set)
settings.update(from_flags)
print(settings["source"] or "synthetic", settings["part"] or "-")
PYTHON
}

# Trainers of one VM split WebDataset shards among themselves, unless the user chose a part.
split_data=0
if [[ $role == trainer ]] && ((trainers > 1)); then
    read -r data_source data_part < <(data_settings || echo "unknown -")
    if [[ $data_source == webdataset && $data_part == - ]]; then
        split_data=1
    fi
fi

# build_command [N]: the command of trainer N (or of the coordinator) in the array `command`.
build_command() {
    local index=${1:-0}
    # port 0 is "any free port": every trainer gets one of its own
    local peer_port=$((port > 0 ? port + index : 0)) peer_metrics_port=$((metrics_port > 0 ? metrics_port + index : 0))
    if [[ $role == coordinator ]]; then
        # The coordinator keeps its identity and checkpoints in the state dir; the join address also lands
        # in a file there, for tools.
        command=("$geotrain" coordinator --host 0.0.0.0 --port "$port" --announce-host "$announce_host"
            --state-dir "$state_dir" --initial-peers-file "$state_dir/initial-peers.txt")
    else
        command=("$geotrain" peer)
        for address in "${initial_peers[@]}"; do
            command+=(--initial-peers "$address")
        done
        if [[ -n $announce_host ]]; then
            command+=(--host 0.0.0.0 --port "$peer_port" --announce-host "$announce_host")
        else
            # Nobody can dial a VM without a public address, but it can still dial out and train.
            command+=(--client-mode)
        fi
        # on the boot disk, like the identity: a restart rejoins through these peers while the coordinator is down
        command+=(--identity "$state_dir/identity-$index.key" --known-peers-file "$state_dir/known-peers-$index.txt")
    fi
    command+=(--metrics-port "$peer_metrics_port" --metrics-host 0.0.0.0
        --region "${GEOTRAIN_REGION:-unknown}" --cloud "$GEOTRAIN_CLOUD" --instance-type "${GEOTRAIN_INSTANCE_TYPE:-unknown}")
    if [[ $role == trainer ]]; then
        # A spot VM gets a notice before it is taken away; the trainer leaves the swarm cleanly and exits 75.
        local preemption=${GEOTRAIN_PREEMPTION:-$GEOTRAIN_CLOUD}
        command+=(--preemption "$preemption")
        if [[ -n ${GEOTRAIN_METADATA_URL:-} && $preemption =~ ^(aws|gcp|azure)$ ]]; then
            # the notices come from the same (moved) metadata service as everything above
            command+=(--set "preemption.${preemption}_metadata_url=$GEOTRAIN_METADATA_URL")
        fi
        if ((gpus > 0)); then
            command+=(--device "cuda:$index")
        fi
        if ((split_data)); then
            command+=(--data-part "$index/$trainers")
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
}

# Which peers this call starts: the coordinator, trainer N alone, or every trainer of the VM.
if [[ $role == coordinator ]]; then
    indexes=("")
elif [[ -n $only ]]; then
    indexes=("$only")
else
    indexes=()
    for ((index = 0; index < trainers; index++)); do
        indexes+=("$index")
    done
fi
if [[ $role == trainer && -z $announce_host ]]; then
    geotrain_log "no public IPv4 address (set GEOTRAIN_ANNOUNCE_HOST if there is one); joining in client mode"
fi

if [[ ${GEOTRAIN_DRY_RUN:-0} == 1 ]]; then
    printf 'role=%s\ncloud=%s\nregion=%s\ninstance_type=%s\nannounce_host=%s\n' "$role" "$GEOTRAIN_CLOUD" \
        "${GEOTRAIN_REGION:-unknown}" "${GEOTRAIN_INSTANCE_TYPE:-unknown}" "$announce_host"
    if [[ $role == trainer ]]; then
        printf 'gpus=%s\ntrainers=%s\n' "$gpus" "$trainers"
    fi
    for index in "${indexes[@]}"; do
        build_command "$index"
        # command=... for the coordinator, command_N=... for trainer N
        printf 'command%s=' "${index:+_$index}"
        printf '%q ' "${command[@]}"
        printf '\n'
    done
    exit 0
fi
mkdir -p "$state_dir"

if ((${#indexes[@]} == 1)); then
    build_command "${indexes[0]}"
    geotrain_log "starting the ${role}${only:+ $only}: ${command[*]}"
    exec "${command[@]}"
fi

# Several trainers: start each, prefix its output lines with its name, pass SIGTERM and SIGINT on to all
# of them, and when one fails, stop the others, so that whoever runs this (SkyPilot) restarts the VM's
# trainers together. One that ends with 0 (the run is done) leaves the others to end by themselves.
logs=$(mktemp -d)
declare -A running=()   # pid -> trainer index
stop_all() {
    local pid
    for pid in "${!running[@]}"; do
        kill -TERM "$pid" 2>/dev/null || true
    done
}
trap stop_all TERM INT
for index in "${indexes[@]}"; do
    build_command "$index"
    geotrain_log "starting trainer $index: ${command[*]}"
    mkfifo "$logs/trainer-$index"
    # the prefixing reader is this script's child, not geotrain's (geotrain stops all of its own children)
    while IFS= read -r line || [[ -n $line ]]; do printf 'trainer-%s: %s\n' "$index" "$line"; done <"$logs/trainer-$index" &
    "${command[@]}" >"$logs/trainer-$index" 2>&1 &
    running[$!]=$index
done
result=0
while ((${#running[@]} > 0)); do
    sleep 1 &
    wait "$!" || true   # a signal interrupts this wait at once, and the trap runs
    for pid in "${!running[@]}"; do
        if ! kill -0 "$pid" 2>/dev/null; then
            status=0
            wait "$pid" || status=$?
            geotrain_log "trainer ${running[$pid]} exited with status $status"
            unset "running[$pid]"
            if ((status != 0 && result == 0)); then
                result=$status
                stop_all
            fi
        fi
    done
done
wait   # the readers: the last lines of output
rm -rf "$logs"
exit "$result"
