#!/usr/bin/env bash
# The GPU benchmark on a machine with no package index: install the offline bundle, check, measure.
#
#   benchmarks/gpu/run.sh OUTDIR                 # on a GPU: CV, NLP and ASR in bf16 and fp16, about 8 minutes
#   benchmarks/gpu/run.sh --smoke OUTDIR         # on a CPU: the bundle and the benchmark run, about a minute
#   benchmarks/gpu/run.sh OUTDIR -- --presets cv/resnet50 --precision fp16   # more flags for gpu_throughput.py
#
# Needs the bundle that benchmarks/gpu/wheelhouse.py (`make wheelhouse`) made on a machine with the package index,
# for this machine's Python. Installs it into a folder of its own (nothing else on the machine changes), with
# no network: pip --no-index. Then benchmarks/gpu/preflight.py checks that everything imports and a hivemind
# peer starts, and benchmarks/gpu_throughput.py measures within BUDGET_S seconds.
#
# Writes under OUTDIR: run.log (everything printed), environment.json (versions, GPU, problems),
# gpu_throughput.json, gpu_throughput.memory.md and logs.tar.gz (every side's logs and events).
# Environment: WHEELHOUSE (default .wheelhouse in the repo), PYTHON (default python3), GEOTRAIN_SITE (where the
# bundle is installed; default a new temporary folder), BUDGET_S (default 480; smoke 120).
# Exit codes: 0 measured; 1 a side of the benchmark failed (gpu_throughput.json says which); 2 a usage error;
# 3 something is missing (no bundle, a bundle for another Python, a module that does not import, no GPU).
set -uo pipefail

usage() { echo "usage: benchmarks/gpu/run.sh [--smoke] OUTDIR [-- FLAGS FOR gpu_throughput.py]" >&2; exit 2; }

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
smoke=0
outdir=""
extra=()
while (($#)); do
    case "$1" in
        --smoke) smoke=1 ;;
        --) shift; extra=("$@"); break ;;
        -h|--help) sed -n '2,20p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "run.sh: unknown option $1" >&2; usage ;;
        *) [[ -z "$outdir" ]] || { echo "run.sh: one OUTDIR only ($outdir, $1)" >&2; usage; }; outdir="$1" ;;
    esac
    shift
done
[[ -n "$outdir" ]] || usage
mkdir -p "$outdir" || { echo "run.sh: cannot create OUTDIR $outdir" >&2; exit 2; }
outdir="$(cd "$outdir" && pwd)"
if [[ "$outdir" == "$repo/benchmarks/results"* ]] && ((smoke)); then
    echo "run.sh: --smoke measures nothing worth keeping; it does not write into benchmarks/results" >&2
    exit 2
fi

exec > >(tee "$outdir/run.log") 2>&1
fail() { echo "run.sh: $*" >&2; exit 3; }

python="${PYTHON:-python3}"
wheelhouse="${WHEELHOUSE:-$repo/.wheelhouse}"
command -v "$python" >/dev/null || fail "no $python here (set PYTHON)"
[[ -f "$wheelhouse/bundle.json" ]] || fail "no bundle in $wheelhouse (bundle.json missing): run \`make wheelhouse\` \
(benchmarks/gpu/wheelhouse.py) on a machine with the package index, and copy the folder here"
bundle_python="$("$python" -c 'import json,sys; print(json.load(open(sys.argv[1]))["python_version"])' \
    "$wheelhouse/bundle.json")" || fail "cannot read $wheelhouse/bundle.json"
here_python="$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
[[ "$bundle_python" == "$here_python" ]] || fail "the bundle in $wheelhouse is for Python $bundle_python; \
this machine's $python is $here_python: build it with \`make wheelhouse PY_VERSION=$here_python\`"

site="${GEOTRAIN_SITE:-$(mktemp -d "${TMPDIR:-/tmp}/geotrain-site.XXXXXX")}"
wheels=("$wheelhouse"/*.whl)
echo "run.sh: installing ${#wheels[@]} wheels from $wheelhouse into $site (no index)"
started=$SECONDS
"$python" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$site" "${wheels[@]}" || fail "pip could not install the bundle (above)"
echo "run.sh: installed in $((SECONDS - started)) s"
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

preflight=(--out "$outdir/environment.json" --bundle "$wheelhouse/bundle.json" --source "$repo")
((smoke)) || preflight+=(--gpu)
"$python" "$repo/benchmarks/gpu/preflight.py" "${preflight[@]}" || fail "this machine is not ready (above)"

if ((smoke)); then
    benchmark=(--device cpu --smoke --budget-s "${BUDGET_S:-120}")
else
    benchmark=(--device cuda --budget-s "${BUDGET_S:-480}")
fi
cd "$repo" || exit 3
"$python" benchmarks/gpu_throughput.py "${benchmark[@]}" --output "$outdir/gpu_throughput.json" \
    --logs "$outdir/logs" "${extra[@]}"
code=$?
if [[ -d "$outdir/logs" ]]; then
    tar -czf "$outdir/logs.tar.gz" -C "$outdir" logs && rm -rf "$outdir/logs"
fi
echo "run.sh: benchmark exit code $code; results in $outdir"
exit "$code"
