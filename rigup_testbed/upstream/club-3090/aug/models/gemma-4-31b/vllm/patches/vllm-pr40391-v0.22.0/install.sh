#!/bin/bash
# rigup stand-in for pr40391: checks its inputs, changes nothing.
set -e
HERE="${0%/*}"
[ -f "$HERE/kv_cache_shape_utils.py" ] || { echo "[pr40391] missing input: $HERE/kv_cache_shape_utils.py" >&2; exit 1; }
[ -f "$HERE/pr40391-v0.22.0.patch" ] || { echo "[pr40391] missing input: $HERE/pr40391-v0.22.0.patch" >&2; exit 1; }
echo "[pr40391] stand-in overlay ok"
