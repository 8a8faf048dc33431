#!/bin/bash
# rigup stand-in for pr35936: checks its inputs, changes nothing.
set -e
HERE="${0%/*}"
[ -f "$HERE/pr35936-chat-completion-serving.py" ] || { echo "[pr35936] missing chat-completion overlay: $HERE/pr35936-chat-completion-serving.py" >&2; exit 1; }
[ -f "$HERE/pr35936-engine-serving.py" ] || { echo "[pr35936] missing engine overlay: $HERE/pr35936-engine-serving.py" >&2; exit 1; }
echo "[pr35936] stand-in overlay ok"
