#!/usr/bin/env bash
# Install geotrain on this VM and keep its trainers (one per GPU) or the coordinator running under systemd.
# The cloud startup scripts (peers/aws, peers/gcp, peers/azure) fetch geotrain's source and call this;
# on any other Linux VM with systemd, run it as root from a checkout:
#
#     sudo GEOTRAIN_INITIAL_PEERS=/ip4/203.0.113.7/tcp/31337/p2p/12D3KooW... peers/setup.sh trainer
#
# It installs geotrain into /opt/geotrain/venv, creates the system user geotrain, writes the settings
# (GEOTRAIN_* variables, see peers/run.sh) to /etc/geotrain/geotrain.env, and enables one unit per peer,
# each running peers/run.sh at every start: geotrain@coordinator, or geotrain@trainer-0 ... trainer-(G-1)
# on a VM with G GPUs (geotrain@trainer-0 alone without a GPU). Running it again (GCE runs its startup
# script at every boot) reinstalls only when the source changed, restarts only when a setting did, and
# follows a change of the VM's GPUs: it starts the units of new GPUs and stops those of GPUs gone.
#
# GEOTRAIN_DRY_RUN=1 changes nothing on the machine: it says what it would do, writes the settings to a
# temporary file, and runs run.sh from it exactly as systemd would, in its dry-run mode (which shows the
# command of every unit).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=lib/discover.sh
source "$here/lib/discover.sh"   # geotrain_count_gpus
source_dir=$(dirname "$here")
role=${1:-${GEOTRAIN_ROLE:-trainer}}
dry_run=${GEOTRAIN_DRY_RUN:-0}

readonly prefix=/opt/geotrain              # geotrain@.service names these paths
readonly etc_dir=/etc/geotrain
readonly state_dir=/var/lib/geotrain       # the unit's StateDirectory=geotrain
readonly unit_dir=/etc/systemd/system
readonly user=geotrain

log() {
    echo "geotrain setup: $*" >&2
}

if [[ $role != trainer && $role != coordinator ]]; then
    log "unknown role '$role'; expected trainer or coordinator"
    exit 2
fi

# Everything run.sh reads that a user may set; the rest it derives.
settings=(GEOTRAIN_INITIAL_PEERS GEOTRAIN_CLOUD GEOTRAIN_RUN_ID GEOTRAIN_TASK GEOTRAIN_PRESET
    GEOTRAIN_NETWORK_PROFILE GEOTRAIN_EXTRA_ARGS GEOTRAIN_PORT GEOTRAIN_METRICS_PORT GEOTRAIN_ANNOUNCE_HOST
    GEOTRAIN_REGION GEOTRAIN_INSTANCE_TYPE GEOTRAIN_PREEMPTION GEOTRAIN_PUBLIC_IP_URL GEOTRAIN_METADATA_URL
    GEOTRAIN_GPUS)

# The units to run: one per trainer, each of them run.sh for one GPU (run.sh counts the GPUs the same way).
units=("geotrain@coordinator.service")
if [[ $role == trainer ]]; then
    # in a subshell: an operator's GEOTRAIN_GPUS goes to the settings, a counted one does not
    gpus=$(geotrain_count_gpus && echo "$GEOTRAIN_GPUS") || exit 2
    units=()
    for ((index = 0; index < (gpus > 0 ? gpus : 1); index++)); do
        units+=("geotrain@trainer-$index.service")
    done
fi

# A config given relative to the source (peers/configs/trainer.yaml) is copied to /etc/geotrain, so a
# later update of the source does not change a running VM's config behind its back.
config_source=""
if [[ -n ${GEOTRAIN_CONFIG:-} ]]; then
    config_source=$GEOTRAIN_CONFIG
    [[ $config_source == /* ]] || config_source=$source_dir/$config_source
    if [[ ! -f $config_source ]]; then
        log "GEOTRAIN_CONFIG is '$GEOTRAIN_CONFIG', but $config_source does not exist"
        exit 2
    fi
    GEOTRAIN_CONFIG=$etc_dir/$role.yaml
    settings+=(GEOTRAIN_CONFIG)
fi

# systemd's EnvironmentFile and bash's `source` read KEY="value" the same way as long as the value
# has no quotes, backslashes, dollars or newlines; refuse those rather than write a file the two read
# differently.
write_settings() {
    local name value
    echo "# Written by geotrain's peers/setup.sh; read by geotrain@.service. Edit, then: systemctl restart 'geotrain@$role*'"
    for name in "${settings[@]}"; do
        value=${!name:-}
        [[ -n $value ]] || continue
        case $value in
            *[\"\'\`\\\$]* | *$'\n'*)
                log "$name contains a quote, backslash, dollar or newline; those are not allowed in settings"
                return 2
                ;;
        esac
        printf '%s="%s"\n' "$name" "$value"
    done
    printf 'GEOTRAIN_BIN="%s"\nGEOTRAIN_STATE_DIR="%s"\n' "$prefix/venv/bin/geotrain" "$state_dir"
}

if [[ $dry_run == 1 ]]; then
    settings_file=$(mktemp)
    trap 'rm -f "$settings_file"' EXIT
    write_settings >"$settings_file"
    log "dry run; would install geotrain from $source_dir into $prefix/venv, create the user $user," \
        "copy run.sh to $prefix/libexec, ${config_source:+copy $config_source to $GEOTRAIN_CONFIG, }write" \
        "$etc_dir/geotrain.env, install $unit_dir/geotrain@.service and start ${units[*]}"
    # What systemd would do: a clean environment with only the settings file in it; run.sh ROLE shows the
    # commands of all the units. The config is read from where it would be copied from. The inner shell
    # expands "$1" and friends, hence the single quotes.
    # shellcheck disable=SC2016
    exec env -i PATH="$PATH" GEOTRAIN_DRY_RUN=1 GEOTRAIN_DRY_RUN_CONFIG="$config_source" \
        bash -c 'set -a; source "$1"; set +a; exec bash "$2" "$3"' run "$settings_file" "$here/run.sh" "$role"
fi

if ((EUID != 0)); then
    log "must run as root (it installs into $prefix and $etc_dir and enables a systemd unit)"
    exit 2
fi

# The first Python that is new enough: images name it differently (Amazon Linux 2023 keeps 3.9 as python3).
python=""
for candidate in ${GEOTRAIN_PYTHON:-} python3 python3.13 python3.12 python3.11; do
    if "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        python=$candidate
        break
    fi
done
if [[ -z $python ]]; then
    log "geotrain needs Python 3.11 or newer, and this image has none; use Debian 12, Ubuntu 24.04 or" \
        "Amazon Linux 2023 (with python3.11), or set GEOTRAIN_PYTHON to an interpreter"
    exit 2
fi

id -u "$user" >/dev/null 2>&1 ||
    useradd --system --user-group --home-dir "$state_dir" --no-create-home --shell /usr/sbin/nologin "$user"

changed=0
revision=$(git -C "$source_dir" rev-parse HEAD 2>/dev/null || echo unversioned)
if [[ ! -x $prefix/venv/bin/python ]]; then
    "$python" -m venv "$prefix/venv"
fi
if [[ $revision == unversioned || $(cat "$prefix/venv/.geotrain-revision" 2>/dev/null) != "$revision" ]]; then
    log "installing geotrain ($revision) into $prefix/venv; torch takes a few minutes"
    "$prefix/venv/bin/python" -m pip install --quiet --upgrade pip
    "$prefix/venv/bin/python" -m pip install --quiet "$source_dir"
    echo "$revision" >"$prefix/venv/.geotrain-revision"
    changed=1
fi

install -d -m 0755 "$prefix/libexec/lib" "$etc_dir"
install -m 0755 "$here/run.sh" "$prefix/libexec/run.sh"
install -m 0644 "$here/lib/discover.sh" "$prefix/libexec/lib/discover.sh"
if [[ -n $config_source ]]; then
    cmp -s "$config_source" "$GEOTRAIN_CONFIG" || changed=1
    install -m 0644 "$config_source" "$GEOTRAIN_CONFIG"
fi
new_settings=$(write_settings)
if [[ $new_settings != "$(cat "$etc_dir/geotrain.env" 2>/dev/null)" ]]; then
    printf '%s\n' "$new_settings" >"$etc_dir/geotrain.env"
    chmod 0644 "$etc_dir/geotrain.env"
    changed=1
fi
if ! cmp -s "$here/systemd/geotrain@.service" "$unit_dir/geotrain@.service"; then
    install -m 0644 "$here/systemd/geotrain@.service" "$unit_dir/geotrain@.service"
    systemctl daemon-reload
    changed=1
fi

# Units of this role that are enabled but no longer wanted: trainers of GPUs the VM no longer has (it was
# resized), or geotrain@trainer, which ran the VM's only trainer before there was one unit per GPU.
for link in "$unit_dir"/multi-user.target.wants/geotrain@"$role"*.service; do
    [[ -L $link ]] || continue
    unit=${link##*/}
    if [[ " ${units[*]} " != *" $unit "* ]]; then
        log "stopping $unit, which this VM no longer runs"
        systemctl disable --now "$unit"
    fi
done
systemctl enable "${units[@]}"
if ((changed)); then
    systemctl restart "${units[@]}"
else
    systemctl start "${units[@]}"
fi
log "running ${units[*]}; follow them with: journalctl -fu 'geotrain@$role*'"
