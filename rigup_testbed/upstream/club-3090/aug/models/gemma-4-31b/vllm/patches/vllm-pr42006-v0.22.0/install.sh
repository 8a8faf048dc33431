#!/bin/bash
# rigup stand-in for pr42006: checks its inputs, changes nothing.
set -e
HERE="${0%/*}"
[ -f "$HERE/pr42006-v0.22.0.patch" ] || { echo "[pr42006] missing input: $HERE/pr42006-v0.22.0.patch" >&2; exit 1; }
echo "[pr42006] stand-in overlay ok"
