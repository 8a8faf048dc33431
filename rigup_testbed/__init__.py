"""Test bed: Debian 12 hosts booted with systemd-nspawn, each in its own network namespace, reached
over real SSH, plus a hub namespace serving stand-in apt repositories, git remotes and a Hugging Face
endpoint. Needs root, debootstrap, systemd-nspawn, iproute2 and util-linux's unshare."""

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
STANDINS_DIR = PACKAGE_DIR / "standins"  # installed into the hosts' images
RESPONDER_SCRIPT = PACKAGE_DIR / "openai_responder.py"  # the rich OpenAI responder, run as a process
