#!/usr/bin/python3
"""Stand-in for lspci (package pciutils): lists the simulated NVIDIA GPUs of hardware.json.

A container's real lspci would list the machine's own devices and never the simulated GPUs, so this
prints a host bridge plus, per GPU, its VGA and HDMI-audio functions, in the formats rigup may ask for:
plain, -nn (numeric ids), -D (with domain), -d VENDOR[:DEVICE] filters, -mm (machine readable), -s SLOT.
PCI device ids come from the GPU name (hardware.json "pci_device_id" overrides).
"""

from __future__ import annotations

import sys

import common

LOG = "/var/log/nvidia-standin/calls.log"

# name -> (device id, chip name, audio device id)
CHIPS = {
    "NVIDIA GeForce RTX 3090": ("2204", "GA102 [GeForce RTX 3090]", "1aef"),
    "NVIDIA GeForce RTX 3090 Ti": ("2203", "GA102 [GeForce RTX 3090 Ti]", "1aef"),
    "NVIDIA GeForce RTX 3080": ("2206", "GA102 [GeForce RTX 3080]", "1aef"),
    "NVIDIA GeForce RTX 4090": ("2684", "AD102 [GeForce RTX 4090]", "22ba"),
    "NVIDIA GeForce RTX 2080 Ti": ("1e04", "TU102 [GeForce RTX 2080 Ti Rev. A]", "10f7"),
    "NVIDIA H200": ("2335", "GH100 [H200 SXM 141GB]", None),
}


def devices() -> list[dict[str, str]]:
    out = [{"slot": "0000:00:00.0", "cls": "Host bridge", "cc": "0600", "vendor": "8086",
            "vname": "Intel Corporation", "dev": "1237", "dname": "440FX - 82441FX PMC [Natoma]", "rev": "02"}]
    for gpu in common.hardware().get("gpus", []):
        dev, chip, audio = CHIPS.get(gpu["name"], ("2204", gpu["name"], "1aef"))
        dev = str(gpu.get("pci_device_id", dev)).lower().replace("0x", "")[:4]
        slot = gpu["pci_bus_id"][4:].lower()
        out.append({"slot": slot, "cls": "VGA compatible controller", "cc": "0300", "vendor": "10de",
                    "vname": "NVIDIA Corporation", "dev": dev, "dname": chip, "rev": "a1"})
        if audio:
            out.append({"slot": slot[:-1] + "1", "cls": "Audio device", "cc": "0403", "vendor": "10de",
                        "vname": "NVIDIA Corporation", "dev": audio,
                        "dname": chip.split(" ")[0] + " High Definition Audio Controller", "rev": "a1"})
    return out


def main(argv: list[str]) -> int:
    common.log_call(LOG, "lspci", argv)
    numeric = domain = mm = False
    vendor_filter = slot_filter = None
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("-nn", "-n"):
            numeric = True
        elif a == "-D":
            domain = True
        elif a in ("-mm", "-m"):
            mm = True
        elif a in ("-d", "-s") and i + 1 < len(argv):
            i += 1
            if a == "-d":
                vendor_filter = argv[i]
            else:
                slot_filter = argv[i]
        elif a in ("-k", "-v", "-vv", "-q"):
            pass
        else:
            sys.stderr.write(f"lspci: -{a.lstrip('-')}: not simulated by the test-bed stand-in\n")
            return 1
        i += 1
    for d in devices():
        if vendor_filter:
            v, _, dv = vendor_filter.partition(":")
            if (v and v.lower() != d["vendor"]) or (dv and dv.lower() != d["dev"]):
                continue
        slot = d["slot"] if domain else d["slot"][5:]
        if slot_filter and not d["slot"].endswith(slot_filter.lower()):
            continue
        if mm:
            print(f'{slot} "{d["cls"]}" "{d["vname"]}" "{d["dname"]}" -r{d["rev"]} "" ""')
        elif numeric:
            print(f"{slot} {d['cls']} [{d['cc']}]: {d['vname']} {d['dname']} [{d['vendor']}:{d['dev']}] (rev {d['rev']})")
        else:
            print(f"{slot} {d['cls']}: {d['vname']} {d['dname']} (rev {d['rev']})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
