"""Secrets on the control machine: the user's API key and the HF token, read only from 0600 files or the environment."""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rigup.desired.knobs import knob


class SecretError(ValueError):
    """A secret file on the control machine cannot be used (missing, empty, readable by others)."""


def check_private_file(file: Path, knob: str) -> None:
    """Refuses (SecretError) a file that is missing, not a regular file, or readable by group or others."""
    try:
        info = file.stat()
    except FileNotFoundError:
        raise SecretError(f"{knob}: {file} does not exist") from None
    if not stat.S_ISREG(info.st_mode):
        raise SecretError(f"{knob}: {file} is not a regular file")
    if info.st_mode & 0o077:
        raise SecretError(
            f"{knob}: {file} is readable by group or others (mode {stat.S_IMODE(info.st_mode):04o}); chmod 600 it"
        )


def read_secret_file(path: str | os.PathLike[str], knob: str) -> str:
    """The one-line secret in `path` (stripped). Refuses files group or others can read."""
    file = Path(path).expanduser()
    check_private_file(file, knob)
    value = file.read_text(encoding="utf-8").strip()
    if not value or "\n" in value:
        raise SecretError(f"{knob}: {file} must hold exactly one non-empty line")
    return value


def make_secret_file(path: Path) -> None:
    """A new random secret (secrets.token_hex(32)) in `path`, 0600, unless one is there. The file appears whole or not
    at all (written under another name, then linked), so two plans made at once read the same secret. The caller
    makes the directory (0700)."""
    if path.exists():
        return
    part = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(32) + "\n")
        try:
            os.link(part, path)
        except FileExistsError:
            pass  # another plan made it first: that one is the secret
    finally:
        part.unlink()


def load_api_key(host_data: Mapping[str, Any]) -> str | None:
    """The user's API key from `serving_api_key_file` on the control machine; None: not set, the pods carry their
    model's key made on the control machine instead (rigup.desired.pod_keys)."""
    path = knob(host_data, "serving_api_key_file")
    return None if path is None else read_secret_file(path, "serving_api_key_file")


def read_hf_token(token_file: str | None) -> str | None:
    """HF_TOKEN from the control machine's environment, else from the file the hf_token_file knob names
    (the same rule as every secret file: read_secret_file); None when neither is set."""
    token = os.environ.get("HF_TOKEN", "").strip()
    if token:
        return token
    return None if not token_file else read_secret_file(token_file, "hf_token_file")


def secrets_configured(host_data: Mapping[str, Any]) -> tuple[bool, bool]:
    """(HF token, API key) configured for this host, judged without reading the files (previews). Every pod has
    an API key: the user's (serving_api_key_file) or its model's (rigup.desired.pod_keys)."""
    hf = bool(os.environ.get("HF_TOKEN", "").strip()) or knob(host_data, "hf_token_file") is not None
    return hf, True
