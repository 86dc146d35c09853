#!/usr/bin/env bash
# SkyPilot's `setup` step for geotrain: install the synced source (SkyPilot's workdir, the repository
# root) into ~/geotrain-venv. SkyPilot's default images carry Python 3.10 and geotrain needs 3.11, so
# uv provides the interpreter (it downloads one when the image has none).
set -euo pipefail

venv=${GEOTRAIN_VENV:-$HOME/geotrain-venv}
uv=$(command -v uv || echo "$HOME/.local/bin/uv")
if [[ ! -x $uv ]]; then
    # Newer images mark the system Python as externally managed (PEP 668); uv alone is safe to add.
    python3 -m pip install --user --quiet uv || python3 -m pip install --user --quiet --break-system-packages uv
fi
"$uv" venv --quiet --allow-existing --python 3.11 "$venv"
"$uv" pip install --quiet --python "$venv/bin/python" .
"$venv/bin/geotrain" --help >/dev/null
echo "geotrain installed in $venv"
