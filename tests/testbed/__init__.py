"""Test bed: Debian 12 hosts booted with systemd-nspawn, each in its own network namespace, reached
over real SSH, plus a hub namespace serving stand-in apt repositories, git remotes and a Hugging Face
endpoint. Needs root, debootstrap, systemd-nspawn, iproute2 and util-linux's unshare."""
