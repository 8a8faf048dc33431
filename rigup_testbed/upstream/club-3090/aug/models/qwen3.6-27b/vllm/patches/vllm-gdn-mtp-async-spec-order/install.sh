#!/bin/bash
# rigup stand-in for gdn-async-order: checks its inputs, changes nothing.
set -e
HERE="${0%/*}"
[ -f "$HERE/patch_gdn_mtp_async_spec_order.py" ] || { echo "[gdn-async-order] missing input: $HERE/patch_gdn_mtp_async_spec_order.py" >&2; exit 1; }
echo "[gdn-async-order] stand-in overlay ok"
