"""Secrets on the control machine: the API key and the HF token, read only from 0600 files or the environment."""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only for hints: the functions below import rigup.desired.recipe lazily
    pass
from rigup.desired.lock import LockError


class SecretError(ValueError):
    """A secret file on the control machine cannot be used (missing, empty, readable by others)."""


def read_secret_file(path: str | os.PathLike[str], knob: str) -> str:
    """The one-line secret in `path` (stripped). Refuses files group or others can read."""
    file = Path(path).expanduser()
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
    value = file.read_text(encoding="utf-8").strip()
    if not value or "\n" in value:
        raise SecretError(f"{knob}: {file} must hold exactly one non-empty line")
    return value


def load_api_key(host_data: Mapping[str, Any]) -> str | None:
    """The API key from `serving_api_key_file` on the control machine; None: the API is open."""
    path = host_data.get("serving_api_key_file")
    return None if path is None else read_secret_file(path, "serving_api_key_file")


def read_hf_token(token_file: str | None) -> str | None:
    """HF_TOKEN from the environment, else from a 0600 file (knob hf_token_file)."""
    token = os.environ.get("HF_TOKEN")
    if token:
        return token.strip()
    if not token_file:
        return None
    path = Path(token_file).expanduser()
    try:
        st = path.stat()
    except FileNotFoundError:
        raise LockError(f"hf_token_file {path} does not exist") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise LockError(f"hf_token_file {path} is readable by others (mode {st.st_mode & 0o777:o}); chmod 600 it")
    token = path.read_text().strip()
    return token or None

