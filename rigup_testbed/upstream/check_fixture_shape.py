#!/usr/bin/env python3
"""Dev tool: compare the fixture compose files under this directory with upstream's.

Not part of the test suite (CI has no mirror of the upstream repositories); do not import it
from tests.

Usage:
    python check_fixture_shape.py MIRROR_DIR [TREE=OWNER+NAME@COMMIT ...] [--compose BIN]

MIRROR_DIR holds one bare snapshot per repository at MIRROR_DIR/<owner>+<name>/repo (read with
``git -C ... show COMMIT:PATH``).  Each TREE=... maps a fixture tree (a directory under this
one, e.g. ``club-3090/aug``) to the upstream repository and commit it models; with none given,
the four trees described in README.md are checked.  With --compose BIN, every fixture file is
also run through ``BIN -f FILE config -q`` from its own directory (VLLM_NIGHTLY_SHA=x set) and
any stderr line other than an unset-variable warning counts as a failure.

For each fixture compose file (*.yml) the checker asserts, against upstream's file at the same
path: the same top-level keys, service names and service keys; equal image, container_name,
restart, ports, volumes, environment, command, deploy, shm_size and ipc; an entrypoint argv of
the same length with the same first two and last items; the same machine-readable header lines
(``# Requires-*``, ``# Engine-profile``, ``# Tensor-parallel``); and that every bind-mount
source inside the repository (outside patches/genesis and the cache directories) exists in the
fixture tree.  Exit status 1 when anything differs.
"""
import argparse
import os
import posixpath
import re
import subprocess
import sys

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TREES = {
    "club-3090/spring": "noonghunna+club-3090@2e934ad18ad70d98e2e314ca3a96759935393949",
    "club-3090/may": "noonghunna+club-3090@b3010249760bace22b9c94e31b089e2e68f9f817",
    "club-3090/aug": "noonghunna+club-3090@4a29ab57d42a1d587de1042fa5dfd9535f94a063",
    "qwen36-dual-3090/frozen": "noonghunna+qwen36-dual-3090@bbb84da00ecb5186947e964e2a55f9f9aa9a7e12",
}
EQUAL_KEYS = ("image", "container_name", "restart", "ports", "volumes", "environment",
              "command", "deploy", "shm_size", "ipc")
HEADER = re.compile(r"^#\s*(Requires-[A-Za-z-]+|Engine-profile|Tensor-parallel):.*$")
UNSET_WARNING = re.compile(r'variable is not set\. Defaulting to a blank string')


def headers(text):
    return [line.strip() for line in text.splitlines() if HEADER.match(line.strip())]


def mount_sources(rel, svc):
    """Repository-relative bind-mount sources that must exist in the tree."""
    for vol in svc.get("volumes") or []:
        if not isinstance(vol, str) or vol.startswith("$") or vol.startswith("/"):
            continue
        path = posixpath.normpath(posixpath.join(posixpath.dirname(rel), vol.split(":", 1)[0]))
        if path.startswith("..") or "patches/genesis" in path or "/cache/" in path or path.startswith("cache/"):
            continue
        yield path


def check_file(tree_dir, rel, upstream_text):
    problems = []
    ours_text = open(os.path.join(tree_dir, rel)).read()
    ours, theirs = yaml.safe_load(ours_text), yaml.safe_load(upstream_text)
    if list(ours) != list(theirs):
        problems.append(f"top-level keys {list(ours)} != {list(theirs)}")
    if headers(ours_text) != headers(upstream_text):
        problems.append(f"headers {headers(ours_text)} != {headers(upstream_text)}")
    o_svcs, t_svcs = ours.get("services") or {}, theirs.get("services") or {}
    if list(o_svcs) != list(t_svcs):
        problems.append(f"services {list(o_svcs)} != {list(t_svcs)}")
    for name in t_svcs:
        o, t = o_svcs.get(name) or {}, t_svcs[name]
        if list(o) != list(t):
            problems.append(f"{name}: keys {list(o)} != {list(t)}")
        for key in EQUAL_KEYS:
            if o.get(key) != t.get(key):
                problems.append(f"{name}.{key} differs:\n    ours:     {o.get(key)!r}\n    upstream: {t.get(key)!r}")
        oe, te = o.get("entrypoint"), t.get("entrypoint")
        if (oe is None) != (te is None):
            problems.append(f"{name}.entrypoint present in one file only")
        elif te is not None:
            if isinstance(te, str) or isinstance(oe, str):
                if type(te) is not type(oe):
                    problems.append(f"{name}.entrypoint form differs (string vs list)")
            elif len(oe) != len(te) or oe[:2] != te[:2] or oe[-1] != te[-1]:
                problems.append(f"{name}.entrypoint argv shape differs: "
                                f"{[a if len(a) < 30 else '<script>' for a in oe]} vs "
                                f"{[a if len(a) < 30 else '<script>' for a in te]}")
        for path in mount_sources(rel, o):
            if not os.path.exists(os.path.join(tree_dir, path)):
                problems.append(f"{name}: bind-mount source {path} missing from the fixture tree")
    return problems


def compose_config(binary, path):
    env = dict(os.environ, VLLM_NIGHTLY_SHA="x")
    res = subprocess.run([binary, "-f", os.path.basename(path), "config", "-q"], cwd=os.path.dirname(path),
                         env=env, capture_output=True, text=True)
    noise = [l for l in res.stderr.splitlines() if l.strip() and not UNSET_WARNING.search(l)]
    return res.returncode, noise


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mirror_dir")
    ap.add_argument("trees", nargs="*", metavar="TREE=OWNER+NAME@COMMIT")
    ap.add_argument("--compose", metavar="BIN", help="docker compose v2 binary to run `config -q` with")
    args = ap.parse_args(argv)
    mapping = dict(DEFAULT_TREES)
    if args.trees:
        mapping = {}
        for spec in args.trees:
            tree, _, src = spec.partition("=")
            mapping[tree] = src
    failed = 0
    for tree, src in mapping.items():
        repo_name, _, commit = src.partition("@")
        git_dir = os.path.join(args.mirror_dir, repo_name, "repo")
        tree_dir = os.path.join(HERE, tree)
        for root, _, files in sorted(os.walk(tree_dir)):
            for fn in sorted(files):
                if not fn.endswith(".yml"):
                    continue
                rel = os.path.relpath(os.path.join(root, fn), tree_dir)
                res = subprocess.run(["git", "-C", git_dir, "show", f"{commit}:{rel}"], capture_output=True, text=True)
                if res.returncode:
                    print(f"FAIL {tree}/{rel}: not in {repo_name}@{commit[:7]}")
                    failed += 1
                    continue
                problems = check_file(tree_dir, rel, res.stdout)
                status = "shape ok"
                if args.compose:
                    rc, noise = compose_config(args.compose, os.path.join(tree_dir, rel))
                    if rc or noise:
                        problems.append(f"compose config rc={rc}: " + " | ".join(noise))
                    else:
                        status += ", compose config ok"
                if problems:
                    failed += 1
                    print(f"FAIL {tree}/{rel}")
                    for p in problems:
                        print("  - " + p)
                else:
                    print(f"ok   {tree}/{rel} ({status})")
    print(f"{failed} file(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
