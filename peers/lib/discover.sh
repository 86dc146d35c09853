# shellcheck shell=bash
# What a cloud VM must know about itself before it joins a swarm: its public address (to announce to
# other peers), its region and instance type (labels of its metrics), and which cloud it is on (which
# preemption notices to watch), all from the cloud's metadata service; and how many GPUs it has (how many
# trainers to start), from nvidia-smi.
#
# Sourced by peers/run.sh (and peers/setup.sh, for the GPUs); on a VM, run it alone to see what a peer
# would announce and how many trainers it would start:
#
#     bash peers/lib/discover.sh [aws|gcp|azure|auto]
#
# geotrain_discover CLOUD sets GEOTRAIN_CLOUD, GEOTRAIN_REGION, GEOTRAIN_INSTANCE_TYPE and
# GEOTRAIN_PUBLIC_IP (empty when the VM has no public address). A region or instance type already set
# in the environment wins, so an operator can relabel a VM; the announced address is overridden with
# GEOTRAIN_ANNOUNCE_HOST in run.sh. GEOTRAIN_METADATA_URL replaces the metadata service's
# base URL (tests point it at a server on loopback; nobody else needs it).
#
# geotrain_count_gpus sets GEOTRAIN_GPUS, the number of NVIDIA GPUs the VM has (a VM runs one trainer per
# GPU), unless the operator (or SkyPilot, see peers/skypilot/trainer.yaml) already set it.

# Each cloud's documented metadata endpoint. GCE answers on the name it documents; AWS and Azure
# only on the link-local address.
GEOTRAIN_METADATA_AWS=http://169.254.169.254
GEOTRAIN_METADATA_GCP=http://metadata.google.internal
GEOTRAIN_METADATA_AZURE=http://169.254.169.254
# Azure keeps old API versions working for years; this one has every field read below.
GEOTRAIN_AZURE_API_VERSION=2021-02-01

geotrain_log() {
    echo "geotrain: $*" >&2
}

# _geotrain_http METHOD URL [HEADER...]: print the body of a 200 answer and return 0; return 4 on 404
# (the metadata services' "this VM has no such thing", e.g. no public address); return 1 on anything
# else, with the reason on stderr.
_geotrain_http() {
    local method=$1 url=$2 response status
    shift 2
    local headers=()
    local header
    for header in "$@"; do
        headers+=(--header "$header")
    done
    # --noproxy: metadata services are link-local and must never be asked through a proxy (Azure
    # documents this); --retry: right after boot the metadata service can refuse the first connection.
    if ! response=$(curl --silent --show-error --noproxy '*' --connect-timeout "${GEOTRAIN_METADATA_CONNECT_TIMEOUT_S:-2}" \
        --max-time 5 --retry "${GEOTRAIN_METADATA_RETRIES:-3}" --retry-connrefused --retry-delay 1 \
        --request "$method" "${headers[@]}" --write-out '\n%{http_code}' "$url"); then
        geotrain_log "metadata request $method $url failed"
        return 1
    fi
    status=${response##*$'\n'}
    case $status in
        200) printf '%s' "${response%$'\n'*}" ;;
        404) return 4 ;;
        *)
            geotrain_log "metadata request $method $url answered HTTP $status"
            return 1
            ;;
    esac
}

_geotrain_is_ipv4() {
    [[ $1 =~ ^[0-9]{1,3}(\.[0-9]{1,3}){3}$ ]]
}

# _geotrain_set NAME VALUE: set NAME unless the operator already did.
_geotrain_set() {
    if [[ -z ${!1:-} ]]; then
        printf -v "$1" '%s' "$2"
    fi
}

# _geotrain_set_public_ip ADDRESS: the metadata's public address, else what the echo service at
# GEOTRAIN_PUBLIC_IP_URL says (if one is configured), else empty.
_geotrain_set_public_ip() {
    local address=$1
    if [[ -z $address && -n ${GEOTRAIN_PUBLIC_IP_URL:-} ]]; then
        # Opt-in only: behind a NAT gateway an echo service sees the gateway, not an address peers can dial.
        address=$(curl --silent --show-error --fail --max-time 10 "$GEOTRAIN_PUBLIC_IP_URL" | tr -d '[:space:]') || address=""
    fi
    if [[ -n $address ]] && ! _geotrain_is_ipv4 "$address"; then
        geotrain_log "the public address from the metadata service, '$address', is not an IPv4 address; ignoring it"
        address=""
    fi
    GEOTRAIN_PUBLIC_IP=$address
}

geotrain_discover_aws() {
    local base=${GEOTRAIN_METADATA_URL:-$GEOTRAIN_METADATA_AWS} token region instance_type public_ip status=0
    # IMDSv2: a session token first. Instances launched with IMDSv2 required (the default for new AMIs)
    # answer 401 to any request without it.
    token=$(_geotrain_http PUT "$base/latest/api/token" "X-aws-ec2-metadata-token-ttl-seconds: 300") || return 1
    local auth="X-aws-ec2-metadata-token: $token"
    region=$(_geotrain_http GET "$base/latest/meta-data/placement/region" "$auth") || return 1
    instance_type=$(_geotrain_http GET "$base/latest/meta-data/instance-type" "$auth") || return 1
    # 404: the instance has no public IPv4 address (a private subnet).
    public_ip=$(_geotrain_http GET "$base/latest/meta-data/public-ipv4" "$auth") || status=$?
    if ((status == 4)); then public_ip=""; elif ((status != 0)); then return 1; fi
    GEOTRAIN_CLOUD=aws
    _geotrain_set GEOTRAIN_REGION "$region"
    _geotrain_set GEOTRAIN_INSTANCE_TYPE "$instance_type"
    _geotrain_set_public_ip "$public_ip"
}

geotrain_discover_gcp() {
    local base=${GEOTRAIN_METADATA_URL:-$GEOTRAIN_METADATA_GCP}/computeMetadata/v1/instance
    local flavor="Metadata-Flavor: Google" zone machine_type public_ip status=0
    zone=$(_geotrain_http GET "$base/zone" "$flavor") || return 1                         # projects/NUM/zones/us-central1-a
    machine_type=$(_geotrain_http GET "$base/machine-type" "$flavor") || return 1         # projects/NUM/machineTypes/n1-standard-8
    # 404: the first interface has no access config, i.e. no external address.
    public_ip=$(_geotrain_http GET "$base/network-interfaces/0/access-configs/0/external-ip" "$flavor") || status=$?
    if ((status == 4)); then public_ip=""; elif ((status != 0)); then return 1; fi
    zone=${zone##*/}
    if [[ ! $zone =~ ^[a-z]+-[a-z]+[0-9]+-[a-z]$ ]]; then
        geotrain_log "GCE metadata gave the zone '$zone'; expected the form us-central1-a"
        return 1
    fi
    GEOTRAIN_CLOUD=gcp
    _geotrain_set GEOTRAIN_REGION "${zone%-*}"     # a zone's region is its name without the last part
    _geotrain_set GEOTRAIN_INSTANCE_TYPE "${machine_type##*/}"
    _geotrain_set_public_ip "$public_ip"
}

geotrain_discover_azure() {
    local base=${GEOTRAIN_METADATA_URL:-$GEOTRAIN_METADATA_AZURE} document facts
    document=$(_geotrain_http GET "$base/metadata/instance?api-version=$GEOTRAIN_AZURE_API_VERSION" "Metadata: true") || return 1
    # Python is on every VM that runs geotrain; jq is not.
    facts=$(python3 -c '
import json, sys
document = json.loads(sys.stdin.read())
compute = document["compute"]
addresses = document["network"]["interface"][0]["ipv4"]["ipAddress"]
print(compute["location"], compute["vmSize"], addresses[0].get("publicIpAddress", "") if addresses else "", sep="\t")
' <<<"$document") || {
        geotrain_log "Azure metadata document lacks compute.location, compute.vmSize or network.interface[0]"
        return 1
    }
    local location vm_size public_ip
    IFS=$'\t' read -r location vm_size public_ip <<<"$facts"
    GEOTRAIN_CLOUD=azure
    _geotrain_set GEOTRAIN_REGION "$location"
    _geotrain_set GEOTRAIN_INSTANCE_TYPE "$vm_size"
    # Empty for Standard-SKU public addresses, which IMDS does not list (only Basic SKU ones).
    _geotrain_set_public_ip "$public_ip"
}

# geotrain_count_gpus: the GPUs `nvidia-smi --list-gpus` lists ("GPU 0: Tesla T4 (UUID: GPU-...)", one
# line each; MIG slices are indented under their GPU and not counted). 0 when there is no nvidia-smi (a
# CPU VM, or an image without the NVIDIA driver) or it fails (a driver that does not match the kernel).
# Returns 2 when GEOTRAIN_GPUS is set but is not a count.
geotrain_count_gpus() {
    local listing
    if [[ -n ${GEOTRAIN_GPUS:-} ]]; then
        if [[ ! $GEOTRAIN_GPUS =~ ^[0-9]+$ ]]; then
            geotrain_log "GEOTRAIN_GPUS is '$GEOTRAIN_GPUS'; expected the number of GPUs to use (0: one CPU trainer)"
            return 2
        fi
        GEOTRAIN_GPUS=$((10#$GEOTRAIN_GPUS))
        return 0
    fi
    GEOTRAIN_GPUS=0
    if ! command -v nvidia-smi >/dev/null; then
        return 0
    fi
    if ! listing=$(nvidia-smi --list-gpus 2>&1); then
        geotrain_log "nvidia-smi failed, so no GPU is used (is the NVIDIA driver loaded?): ${listing%%$'\n'*}"
        return 0
    fi
    GEOTRAIN_GPUS=$(grep -c '^GPU [0-9]' <<<"$listing" || true)
}

# Which cloud is this? Each probe asks the one question only that cloud's metadata service answers.
geotrain_detect_cloud() {
    local gcp=${GEOTRAIN_METADATA_URL:-$GEOTRAIN_METADATA_GCP} aws=${GEOTRAIN_METADATA_URL:-$GEOTRAIN_METADATA_AWS}
    local azure=${GEOTRAIN_METADATA_URL:-$GEOTRAIN_METADATA_AZURE}
    # Probes of the wrong cloud must fail fast, not retry.
    if GEOTRAIN_METADATA_RETRIES=0 _geotrain_http GET "$gcp/computeMetadata/v1/instance/zone" "Metadata-Flavor: Google" >/dev/null 2>&1; then
        echo gcp
    elif GEOTRAIN_METADATA_RETRIES=0 _geotrain_http PUT "$aws/latest/api/token" "X-aws-ec2-metadata-token-ttl-seconds: 60" >/dev/null 2>&1; then
        echo aws
    elif GEOTRAIN_METADATA_RETRIES=0 _geotrain_http GET "$azure/metadata/instance?api-version=$GEOTRAIN_AZURE_API_VERSION" "Metadata: true" >/dev/null 2>&1; then
        echo azure
    else
        return 1
    fi
}

# geotrain_discover aws|gcp|azure|auto|none
geotrain_discover() {
    local cloud=${1:-auto}
    if [[ $cloud == auto ]]; then
        cloud=$(geotrain_detect_cloud) || {
            geotrain_log "no cloud metadata service answered (tried GCE, AWS, Azure); set GEOTRAIN_CLOUD=none and" \
                "GEOTRAIN_ANNOUNCE_HOST, GEOTRAIN_REGION, GEOTRAIN_INSTANCE_TYPE by hand on other machines"
            return 1
        }
    fi
    case $cloud in
        aws | gcp | azure)
            "geotrain_discover_$cloud" || {
                geotrain_log "could not read this VM's address and region from the $cloud metadata service"
                return 1
            }
            ;;
        none)
            # A machine outside the three clouds: only what the operator set.
            GEOTRAIN_CLOUD=none
            GEOTRAIN_PUBLIC_IP=""
            ;;
        *)
            geotrain_log "GEOTRAIN_CLOUD is '$cloud'; expected aws, gcp, azure, auto or none"
            return 2
            ;;
    esac
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    set -euo pipefail
    geotrain_discover "${1:-${GEOTRAIN_CLOUD:-auto}}"
    geotrain_count_gpus
    printf 'cloud=%s\nregion=%s\ninstance_type=%s\npublic_ip=%s\ngpus=%s\n' \
        "$GEOTRAIN_CLOUD" "${GEOTRAIN_REGION:-}" "${GEOTRAIN_INSTANCE_TYPE:-}" "${GEOTRAIN_PUBLIC_IP:-}" "$GEOTRAIN_GPUS"
fi
