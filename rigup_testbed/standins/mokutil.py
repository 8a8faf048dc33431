#!/usr/bin/python3
"""Stand-in for mokutil (Secure Boot state of the simulated firmware in hardware.json).

`--sb-state` prints what the real tool prints: "SecureBoot enabled" / "SecureBoot disabled", or, for a
host whose hardware.json has "secure_boot": null (legacy BIOS boot), "EFI variables are not supported on
this system" with exit 255. `--list-new` / `--list-enrolled` answer from "mok_enrolled". Other options
are not simulated and exit 1 saying so.
"""

from __future__ import annotations

import sys

import common

LOG = "/var/log/nvidia-standin/calls.log"


def main(argv: list[str]) -> int:
    common.log_call(LOG, "mokutil", argv)
    hw = common.hardware()
    if "secure_boot" in hw and hw["secure_boot"] is None:
        sys.stderr.write("EFI variables are not supported on this system\n")
        return 255
    if argv == ["--sb-state"]:
        print("SecureBoot enabled" if hw.get("secure_boot") else "SecureBoot disabled")
        return 0
    if argv == ["--list-new"]:
        print("MokNew is empty")
        return 1
    if argv == ["--list-enrolled"]:
        if hw.get("mok_enrolled"):
            print("[key 1]\nSHA1 Fingerprint: 00:11:22:33:44:55:66:77:88:99:aa:bb:cc:dd:ee:ff:00:11:22:33")
            return 0
        print("MokListRT is empty")
        return 1
    sys.stderr.write(f"mokutil stand-in: {' '.join(argv) or '(no option)'} is not simulated\n")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
