#!/bin/bash
# rigup stand-in for pr48375: checks its inputs, changes nothing.
set -e
HERE="${0%/*}"
[ -f "$HERE/patch_mamba_drop_eagle_block.py" ] || { echo "[pr48375] missing input: $HERE/patch_mamba_drop_eagle_block.py" >&2; exit 1; }
echo "[pr48375] stand-in overlay ok"
