#!/bin/bash
# rigup stand-in for w4a8: checks its inputs, changes nothing.
set -e
HERE="${0%/*}"
[ -f "$HERE/patch-inc-w4a8.py" ] || { echo "[w4a8] missing input: $HERE/patch-inc-w4a8.py" >&2; exit 1; }
[ -f "$HERE/patch-negscale-fold.py" ] || { echo "[w4a8] missing input: $HERE/patch-negscale-fold.py" >&2; exit 1; }
echo "[w4a8] stand-in overlay ok"
