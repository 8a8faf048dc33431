"""Fact: the state of the model files on the rig, as the uploaded rigfetch.py checks them from its stamps."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pyinfra.api import FactBase, FactProcessError, QuoteString, StringCommand


class ModelFiles(FactBase[dict[str, Any]]):
    """
    What rigfetch --check says about a manifest: which files need hashing or downloading.

    ``script`` is ``"stale"`` when the uploaded rigfetch.py is missing or not the expected version
    (everything then counts as work).

    .. code:: python

        {
            "script": "ok",
            "files": 9, "ok": 8,
            "work": [{"path": "/opt/rigup/models/x/model-00001.safetensors", "action": "fetch",
                      "size": 123, "part_size": 0}],
            "prune": [],
            "download_bytes": 123, "hash_bytes": 0,
        }
    """

    def command(self, script: str, script_sha256: str, manifest_b64: str, reverify: bool = False) -> StringCommand:
        script_q = QuoteString(script)
        # run as the zipapp it is: its __main__ keeps the bytecode of its modules beside it
        check: list[Any] = ["python3", script_q, "--check", "--manifest-b64", QuoteString(manifest_b64)]
        if reverify:
            check.append("--reverify")
        return StringCommand(
            "if command -v python3 >/dev/null 2>&1 && [ -f",
            script_q,
            "] && [ \"$(sha256sum <",
            script_q,
            ")\" =",
            QuoteString(f"{script_sha256}  -"),
            "]; then",
            *check,
            "; else echo '{\"script\": \"stale\"}'; fi",
        )

    def process(self, output: list[str]) -> dict[str, Any]:
        for line in reversed(output):
            line = line.strip()
            if line.startswith("{"):
                try:
                    data = json.loads(line)
                except ValueError:
                    break
                if data.get("script") == "stale":
                    return {"script": "stale", "files": None, "ok": 0, "work": [], "prune": []}
                data["script"] = "ok"
                return data
        raise FactProcessError(f"rigfetch --check printed no JSON: {output[-3:]!r}")


def model_files_need_work(status: Mapping[str, Any], with_prune: bool = True) -> bool:
    """Whether a ModelFiles status has files to fetch or hash (or, with_prune, to remove), or the script is stale."""
    if status.get("script") == "stale":
        return True
    if status.get("work"):
        return True
    return bool(with_prune and status.get("prune"))

