#!/bin/bash
# rigup stand-in for the 26B-A4B copy of pr40391: checks its inputs, changes nothing.
set -e
HERE="${0%/*}"
for f in kv_cache_shape_utils.py pr40391-v0.22.0.patch; do
  [ -f "$HERE/$f" ] || { echo "[pr40391] missing input: $HERE/$f" >&2; exit 1; }
done
echo "[pr40391] stand-in overlay ok (gemma-4-26b-a4b)"
