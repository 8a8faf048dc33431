#!/bin/bash
# rigup stand-in for pr41800: checks its inputs, changes nothing.
set -e
HERE="${0%/*}"
[ -f "${CLUB3090_PR41800_SITE_PACKAGES:-/usr/local/lib/python3.12/dist-packages}/vllm/entrypoints/utils.py" ] || { echo "[pr41800] missing vllm module: ${CLUB3090_PR41800_SITE_PACKAGES:-/usr/local/lib/python3.12/dist-packages}/vllm/entrypoints/utils.py" >&2; exit 1; }
echo "[pr41800] stand-in overlay ok"
