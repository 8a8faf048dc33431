#!/bin/bash
# rigup stand-in for dflash2: checks its inputs, changes nothing.
set -e
HERE="${0%/*}"
[ -f "$HERE/patch_topk_4arg_compat.py" ] || { echo "[dflash2] missing input: $HERE/patch_topk_4arg_compat.py" >&2; exit 1; }
[ -f "$HERE/_check_applied.py" ] || { echo "[dflash2] missing input: $HERE/_check_applied.py" >&2; exit 1; }
[ -f "$HERE/dflash2-backport.patch" ] || { echo "[dflash2] missing input: $HERE/dflash2-backport.patch" >&2; exit 1; }
echo "[dflash2] stand-in overlay ok"
