#!/usr/bin/env bash
# GCE startup script: install geotrain on a (spot) VM and run one trainer per GPU under systemd; each joins
# the swarm, announces the VM's external address and labels its metrics with its region and machine type,
# all from the metadata server. Edit the settings below, then:
#
#   gcloud compute instances create geotrain-trainer-1 --zone us-central1-a --machine-type n1-standard-8 \
#     --accelerator type=nvidia-tesla-t4,count=1 --provisioning-model SPOT --instance-termination-action STOP \
#     --image-family ubuntu-2404-lts-amd64 --image-project ubuntu-os-cloud --tags geotrain \
#     --metadata-from-file startup-script=peers/gcp/startup-script.sh
#
# A firewall rule for the tag must allow TCP 31337 from the other peers (and 9100 from Prometheus only),
# plus one port more of each per GPU after the first: trainer N listens on 31337 + N, metrics on 9100 + N.
# STOP as the termination action keeps the disk, and with it the peer id. GCE runs this script at every
# boot; setup.sh then changes nothing unless the source or a setting did.
# Output: journalctl -u google-startup-scripts; the trainers: journalctl -u 'geotrain@trainer-*'.
set -euo pipefail
GEOTRAIN_CLOUD=gcp

# ---- settings: edit these (or export them when running this script by hand) --------------------------
# trainer on a spot VM, or coordinator (on an on-demand VM).
GEOTRAIN_ROLE=${GEOTRAIN_ROLE:-trainer}
# Trainers: the address `geotrain coordinator` printed, /ip4/PUBLIC_IP/tcp/31337/p2p/12D3KooW...
GEOTRAIN_INITIAL_PEERS=${GEOTRAIN_INITIAL_PEERS:-}
GEOTRAIN_RUN_ID=${GEOTRAIN_RUN_ID:-geotrain}
# Model, data and optimizer: a YAML file in the repository (or an absolute path on the VM).
GEOTRAIN_CONFIG=${GEOTRAIN_CONFIG:-peers/configs/$GEOTRAIN_ROLE.yaml}
# Where to install geotrain from: a repository you trust (this script runs as root), and a branch,
# tag or commit of it.
GEOTRAIN_GIT_URL=${GEOTRAIN_GIT_URL:-}
GEOTRAIN_GIT_REF=${GEOTRAIN_GIT_REF:-main}
# Empty: the public address from the metadata service.
GEOTRAIN_ANNOUNCE_HOST=${GEOTRAIN_ANNOUNCE_HOST:-}
# More settings (GEOTRAIN_PORT, GEOTRAIN_METRICS_PORT, GEOTRAIN_EXTRA_ARGS, ...): see peers/run.sh.

# ---- bootstrap: identical in every cloud's startup script (tests/deploy checks that) ----------------
log() {
    echo "geotrain startup: $*" >&2
}
if [[ -z ${GEOTRAIN_SOURCE_DIR:-} ]]; then
    if [[ ${GEOTRAIN_DRY_RUN:-0} == 1 ]]; then
        log "a dry run installs nothing; set GEOTRAIN_SOURCE_DIR to a checkout of geotrain"
        exit 2
    fi
    if [[ -z $GEOTRAIN_GIT_URL ]]; then
        log "GEOTRAIN_GIT_URL is empty; set it (top of this script) to the geotrain repository to install"
        exit 2
    fi
    GEOTRAIN_SOURCE_DIR=/opt/geotrain/src
    # git, and Python's venv module, which Debian and Ubuntu ship separately. On a first boot
    # unattended-upgrades may hold the apt lock for a while: wait for it rather than fail.
    if command -v apt-get >/dev/null; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get -o DPkg::Lock::Timeout=600 update -q
        apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends git python3-venv ca-certificates curl
        # geotrain needs Python 3.11; Ubuntu 22.04 (many GPU images) has 3.10 as python3 and 3.11 beside it.
        if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
            apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends python3.11 python3.11-venv || true
        fi
    elif command -v dnf >/dev/null; then
        # Amazon Linux 2023's python3 is 3.9; setup.sh picks python3.11 when python3 is too old.
        dnf install -y -q git python3.11
    fi
    # init + fetch works for a branch, a tag or a commit, on the first boot and on every later one.
    mkdir -p "$GEOTRAIN_SOURCE_DIR"
    git -C "$GEOTRAIN_SOURCE_DIR" init -q
    git -C "$GEOTRAIN_SOURCE_DIR" remote remove origin 2>/dev/null || true
    git -C "$GEOTRAIN_SOURCE_DIR" remote add origin "$GEOTRAIN_GIT_URL"
    git -C "$GEOTRAIN_SOURCE_DIR" fetch -q --depth 1 origin "$GEOTRAIN_GIT_REF"
    git -C "$GEOTRAIN_SOURCE_DIR" checkout -q --force FETCH_HEAD
fi
export GEOTRAIN_CLOUD GEOTRAIN_ROLE GEOTRAIN_INITIAL_PEERS GEOTRAIN_RUN_ID GEOTRAIN_CONFIG GEOTRAIN_ANNOUNCE_HOST
exec bash "$GEOTRAIN_SOURCE_DIR/peers/setup.sh" "$GEOTRAIN_ROLE"
