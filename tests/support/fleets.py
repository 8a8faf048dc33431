"""Fleet files the unit tests share: the same small fleet read by the fleet file's loader, the image mirror's
plan and the FleetPlan, so a change to how a fleet is written is made once."""

from __future__ import annotations

import textwrap
from pathlib import Path

# Three rigs pulling through rig-01's image mirror, and a gateway-only host that serves nothing, names no
# mirror and has a gateway key (KEY: the path of a 0600 file write_fleet makes)
MIRROR_FLEET = """
    data:
      image_mirror_host: rig-01
    groups:
      rigs:
        hosts:
          rig-01: {ssh_hostname: 10.0.0.1, image_mirror_port: 5055}
          rig-02: {ssh_hostname: 10.0.0.2}
          rig-03: {ssh_hostname: 10.0.0.3}
      gateway:
        data: {serves_variant: false}
        hosts:
          gw: {ssh_hostname: 10.0.0.9, image_mirror_host: null, gateway_api_key_file: KEY}
"""


def write_fleet(tmp_path: Path, text: str = MIRROR_FLEET) -> Path:
    """rigs.yaml in tmp_path holding `text` (dedented), KEY replaced by a 0600 key file's path."""
    key = tmp_path / "gateway.key"
    key.write_text("sk-gateway\n")
    key.chmod(0o600)
    path = tmp_path / "rigs.yaml"
    path.write_text(textwrap.dedent(text).replace("KEY", str(key)))
    return path
