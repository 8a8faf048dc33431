"""`rigup lock`: resolve what the fleet's variants need into exact pins (rigs.lock.yaml); --upgrade moves pins on purpose and prints the difference.

Pins no host's variant needs any more are kept (a host may go back to its variant) and listed as
"kept, unused: NAME"; --prune removes them ("pruned: NAME"). --check exits 1 only when a pin the
fleet needs is missing or stale; unused pins are listed, not a failure."""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import Any

from rigup.desired.fleet import FleetError, load_fleet
from rigup.desired.fleet_plan import fleet_entries, plan_fleet
from rigup.desired.lock import LOCK_COMMAND, LockError, LockFile, lock_path, need_problem
from rigup.desired.pins import Resolver, fleet_lock_file, update_lock
from rigup.desired.recipe import RecipeError, pods_of, resolve
from rigup.desired.roles import serves_variant
from rigup.desired.secrets import SecretError, read_hf_token
from rigup.desired.trust import fleet_bundle, system_ca_bundle


def run_lock(args: argparse.Namespace, out: Any = None) -> int:
    out = out or sys.stdout

    def say(text: str) -> None:
        print(text, file=out)

    try:
        fleet = load_fleet(args.fleet)
        path = lock_path(fleet_lock_file(fleet), fleet.path.parent)
        try:
            old = LockFile.load(path)
        except LockError:
            if path.exists():
                raise
            old = LockFile(path=path)
        plan = plan_fleet(fleet_entries(fleet))  # the fleet's lock needs are collected by its FleetPlan
        needs, _ = plan.lock_needs(old if path.exists() else None)
        if args.check:
            problems = [p for p in (need_problem(n, old) for n in needs.values()) if p is not None]
            extra = [n for n in old.names() if n not in needs]
            if not path.exists():
                say(f"{path}: missing")
                return 1
            for problem in problems:
                say(f"stale: {problem}")
            for name in extra:
                say(f"unused: {name}")
            if extra:
                say(f"{path}: {_count(len(extra))} no host needs (kept; `{LOCK_COMMAND} --prune` removes them)")
            if problems:
                say(f"{path}: {len(problems)} entries missing or stale; run `{LOCK_COMMAND}`")
                return 1
            say(f"{path}: covers all {len(needs)} pins the fleet needs")
            return 0
        token = read_hf_token(_fleet_token_file(fleet))
        # HTTPS checked against the fleet's ca_bundle (load_fleet read it), else the system's store, never certifi's
        resolver = Resolver(hf_token=token, image_digests=args.image_digests, log=(say if args.verbose else None),
                            ca_bundle=fleet_bundle() or system_ca_bundle())
        upgrade = None if args.upgrade is None else list(args.upgrade)
        new, changes = update_lock(old, needs, resolver, upgrade, prune=args.prune)
        # A moved recipe repository can mount from other sources: pin what the new commits need too.
        needs_after, _ = plan.lock_needs(new)
        if set(needs_after) - set(needs):
            new, more = update_lock(new, needs_after, resolver, None, prune=args.prune)
            changes += [c for c in more if c.kind not in ("unused", "pruned", "kept")]
            needs = needs_after
        diffs = rendered_diffs(fleet, old, new) if path.exists() else []
    except (LockError, FleetError, RecipeError, SecretError) as exc:
        print(f"rigup lock: {exc}", file=sys.stderr)
        return 2
    unused = [c.name for c in changes if c.kind == "unused"]
    pruned = [c.name for c in changes if c.kind == "pruned"]
    for change in changes:
        if change.kind in ("unused", "pruned"):
            continue
        say(f"{change.kind:9} {change.name}")
        for line in change.lines:
            say(f"          {line}")
    for title, lines in diffs:
        say(title)
        for line in lines:
            say(f"  {line}")
    for name in unused:
        say(f"kept, unused: {name}")
    if unused:
        say(f"{path}: kept {_count(len(unused))} no host needs; `{LOCK_COMMAND} --prune` removes them")
    for name in pruned:
        say(f"pruned: {name}")
    if pruned:
        say(f"{path}: pruned {_count(len(pruned))} no host needs")
    pins = f"{len(needs)} pins" + (f", {len(unused)} unused" if unused else "")
    changed = new.dump() != (old.dump() if path.exists() else "")
    if args.dry_run:
        say(f"{path}: {'would change' if changed else 'unchanged'} (dry run)")
        return 0
    if changed:
        new.save(path)
        say(f"{path}: written ({pins}); commit it")
    else:
        say(f"{path}: unchanged ({pins})")
    return 0


def rendered_diffs(fleet: Any, old: LockFile, new: LockFile) -> list[tuple[str, list[str]]]:
    """For each variant the fleet runs whose rendered compose file the new pins change: a unified diff."""
    out: list[tuple[str, list[str]]] = []
    seen: set[str] = set()
    # every pod the fleet serves: (host or host/pod, host data, pod)
    served = [(pod.target(h.name), data, pod)
              for h in fleet.hosts for data in [fleet.resolved_data(h.name)] if serves_variant(data)
              for pod in pods_of(data)]
    def body(text: str) -> list[str]:
        return [line for line in text.splitlines() if not line.startswith("#")]

    for _, data, pod in served:
        before, after = resolve(data, old, pod=pod), resolve(data, new, pod=pod)
        if before.compose_text == after.compose_text:
            continue
        lines = list(difflib.unified_diff(
            body(before.compose_text), body(after.compose_text),
            f"{before.variant} at {before.upstream.source}@{before.upstream.commit[:12]}",
            f"{after.variant} at {after.upstream.source}@{after.upstream.commit[:12]}", lineterm="", n=1,
        ))
        # once per variant and change: pods of one variant differ only in names the pins do not touch
        key = "\n".join([before.variant, *(line for line in lines[2:] if not line.startswith("@@"))])
        if key in seen:
            continue
        seen.add(key)
        hosts = [name for name, _, other in served if other.variant == before.variant]
        if not lines:
            out.append((f"rendered {after.paths.compose_file} for {', '.join(hosts)}: only the base commit in its "
                        f"header changes ({before.upstream.commit[:12]} -> {after.upstream.commit[:12]}); "
                        f"the new release still restarts it once", []))
            continue
        out.append((f"rendered {after.paths.compose_file} changes for {', '.join(hosts)}:", lines))
    return out


def _count(n: int) -> str:
    return f"{n} pin{'' if n == 1 else 's'}"


def _fleet_token_file(fleet: Any) -> str | None:
    files = {fleet.resolved_data(h.name).get("hf_token_file") for h in fleet.hosts} - {None}
    if len(files) > 1:
        raise LockError(f"hosts name different hf_token_file values ({sorted(files)}); the lock tool reads one")
    return files.pop() if files else None


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "lock",
        help="pin git commits, model files (SHA-256) and images in rigs.lock.yaml",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--fleet", help="fleet file (default: $RIGUP_RIGS or rigs.yaml)")
    parser.add_argument(
        "--upgrade",
        nargs="*",
        metavar="NAME",
        help="move pins to what the refs point at now: all, or the NAMEs given "
        "(git:genesis, model:<repo id>, image:<repo>:<tag>; the prefix is optional)",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--check", action="store_true", help="only report missing/stale entries (exit 1 if any) and unused ones"
    )
    mode.add_argument(
        "--prune", action="store_true", help="remove the pins no host's variant needs (default: keep and list them)"
    )
    parser.add_argument("--image-digests", action="store_true", help="ask the registry for each image tag's digest")
    parser.add_argument("--dry-run", action="store_true", help="show what would change; write nothing")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each resolution")
    parser.set_defaults(func=run_lock)
    return parser

