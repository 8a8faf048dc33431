"""`rigup render`: write exactly what the deploy would write for a variant; --list lists the variants."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rigup.desired.catalog import variant_names
from rigup.desired.compose_doc import explain
from rigup.desired.fleet import FleetError, load_fleet
from rigup.desired.knobs import load_defaults, parse_data_value
from rigup.desired.lock import LockError, LockFile
from rigup.desired.plan import host_plan
from rigup.desired.recipe import RecipeError, pods_of
from rigup.parsers.topology import TopologyError, topology


def _parse_data(pairs: list[str]) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise RecipeError(f"--data expects key=value, got {pair!r}")
        data[key] = parse_data_value(value)
    return data


def host_data_for_cli(variant: str, data_pairs: list[str]) -> dict[str, Any]:
    """group_data/all.py defaults, then --data overrides, then the variant argument."""
    host_data = load_defaults()
    overrides = _parse_data(data_pairs)
    unknown = sorted(set(overrides) - set(host_data))
    if unknown:
        raise RecipeError(f"--data: unknown knob(s) {', '.join(unknown)} (declared in group_data/all.py)")
    host_data.update(overrides)
    host_data["variant"] = variant
    return host_data


def host_data_of_fleet_host(name: str, fleet_file: str | None, data_pairs: list[str]) -> dict[str, Any]:
    """One host of the fleet file, as the deploy reads it (a cluster member's share included), then --data."""
    # --data is checked with the fleet file's own rules (variant_overrides against the host's variant)
    fleet = load_fleet(fleet_file, data=_parse_data(data_pairs))
    names = [h.name for h in fleet.hosts]
    if name not in names:
        raise RecipeError(f"--host {name!r}: not a host of {fleet.path} (hosts: {', '.join(names) or 'none'})")
    return fleet.resolved_data(name)


def _plan(variant: str | None, args: argparse.Namespace) -> Any:
    if getattr(args, "host", None):
        host_data = host_data_of_fleet_host(args.host, args.fleet, args.data)
    else:
        host_data = host_data_for_cli(variant or str(load_defaults()["variant"]), args.data)
    lock = LockFile.load(args.lock) if args.lock is not None else None
    topo = None
    if args.topo is not None:
        topo = topology(Path(args.topo).read_text(), None if args.p2p is None else Path(args.p2p).read_text())
    pod = None
    listed = [p for p in pods_of(host_data) if p.listed]
    wanted = getattr(args, "pod", None)
    if len(listed) == 1 and wanted is None and getattr(args, "host", None):
        wanted = listed[0].name  # a cluster member's one pod
    if listed and wanted is None:
        where = f"host {args.host}" if getattr(args, "host", None) else "--data pods"
        raise RecipeError(f"{where} lists pods {', '.join(p.name for p in listed)}: render one of them with --pod NAME")
    if wanted is not None:
        pod = next((p for p in listed if p.name == wanted), None)
        if pod is None:
            names = ", ".join(p.name for p in listed) or "none: set --data pods=[...]"
            raise RecipeError(f"--pod {wanted!r}: no such pod in --data pods (pods: {names})")
    return host_plan(host_data, "render", topo, lock=lock, require_lock=False, read_secrets=False, pod=pod)


def _list(args: argparse.Namespace) -> int:
    """Every variant with its port, layout, upstream file and whether upstream still carries it."""
    failed = 0
    for name in variant_names():
        try:
            recipe = _plan(name, args).recipe
        except (RecipeError, LockError, TopologyError, OSError) as exc:
            print(f"{name:34} cannot render: {exc}")
            failed += 1
            continue
        up = recipe.upstream
        print(f"{name:34} :{recipe.host_port:<5} TP={recipe.tensor_parallel_size}  {recipe.upstream_status:8} "
              f"{up.source}@{up.commit[:8]}:{up.path}")
        print(f"{'':34} {recipe.description}")
    return 1 if failed else 0


def _audit(args: argparse.Namespace, variants: list[str]) -> int:
    """--explain: every difference from upstream's file, attributed; exit 1 on any unexplained one."""
    total = 0
    for name in variants:
        try:
            recipe = _plan(name, args).recipe
        except (RecipeError, LockError, TopologyError, FleetError, OSError) as exc:
            print(f"rigup render: {exc}", file=sys.stderr)
            return 2
        name = recipe.variant
        lines, unexplained = explain(recipe.upstream, recipe.compose_text, list(recipe.changes))
        total += unexplained
        if args.explain:
            print(f"{name}:")
            print("\n".join(lines))
        else:
            print(f"{name:34} {lines[-1]}  ({recipe.upstream.source}@{recipe.upstream.commit[:8]}:"
                  f"{recipe.upstream.path})")
    if len(variants) > 1:
        print(f"{len(variants)} variants, unexplained: {total}")
    return 1 if total else 0


def _cmd_render(args: argparse.Namespace) -> int:
    if args.host and (args.list or args.audit or args.variant is not None):
        print("rigup render: --host renders that host's own variant, pods or cluster share: give no VARIANT, "
              "--list or --audit with it", file=sys.stderr)
        return 2
    if args.list:
        return _list(args)
    if args.audit:
        return _audit(args, variant_names())
    if (args.variant is not None or args.host) and args.explain:
        return _audit(args, [args.variant])
    if (args.variant is None and args.pod is None and not args.host) or args.out is None:
        print("rigup render: VARIANT (or --pod NAME with --data pods=[...], or --host NAME of the fleet file) and "
              "--out are required (or --list, --audit, VARIANT --explain, --host NAME --explain)", file=sys.stderr)
        return 2
    try:
        plan = _plan(args.variant, args)
        lock = LockFile.load(args.lock) if args.lock is not None else None
    except (RecipeError, LockError, TopologyError, FleetError, OSError) as exc:
        print(f"rigup render: {exc}", file=sys.stderr)
        return 2
    if lock is not None and plan.lock_problem is not None:
        # Rendered anyway (it is a preview); a deploy refuses to run with this lock.
        print(f"rigup render: warning: {plan.lock_problem}", file=sys.stderr)
    recipe = plan.recipe
    out = Path(args.out)
    for relpath, rendered in sorted(plan.rendered.items()):
        dest = out / relpath
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(rendered.content)
        dest.chmod(int(rendered.mode, 8))
        print(f"{rendered.mode} {dest}")
    if plan.secret_names:
        print(f"secrets the deploy writes as 0600 files of {recipe.paths.secrets_dir}: {', '.join(plan.secret_names)}")
    if lock is not None:
        print(f"pins from {lock.path}:")
        print(f"  {recipe.image.lock_name}: {recipe.image.digest or 'tag only (no digest locked)'}")
        for source in recipe.sources:
            print(f"  {source.lock_name}: {source.commit if source.locked else 'not locked'}")
        for model in recipe.models:
            print(f"  {model.lock_name}: {model.revision or 'not locked'}")
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `render VARIANT --out DIR [--data key=value ...] [--lock FILE] [--topo FILE [--p2p FILE]] [--list]`."""
    parser = subparsers.add_parser(
        "render",
        help="write the compose file, .env and systemd unit a deploy would put on a rig",
        description="Render a variant's rig files under DIR (paths as on the rig, without the leading /).",
    )
    parser.add_argument("variant", nargs="?", metavar="VARIANT", help="catalog variant (see --list)")
    parser.add_argument("--out", metavar="DIR", help="directory to write into")
    parser.add_argument(
        "--data",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a group_data/all.py knob (values parse like pyinfra --data: true/false, ints, JSON, text)",
    )
    parser.add_argument(
        "--lock", metavar="FILE", help="lock file (rigs.lock.yaml): render with its pinned commits, revisions and digests"
    )
    parser.add_argument(
        "--topo", metavar="FILE", help="a host's `nvidia-smi topo -m` output: plan NCCL settings for its interconnect"
    )
    parser.add_argument("--p2p", metavar="FILE", help="with --topo: the host's `nvidia-smi topo -p2p r` output")
    parser.add_argument("--pod", metavar="NAME",
                        help="with --data pods=[...]: render this pod (its GPUs, port, unit and directory)")
    parser.add_argument("--host", metavar="NAME",
                        help="render this host of the fleet file as a deploy would (its variant, pods or cluster "
                             "share; a cluster member's interface and addresses, read on the rig, stay variables)")
    parser.add_argument("--fleet", metavar="FILE", help="with --host: the fleet file (default: $RIGUP_RIGS, else rigs.yaml)")
    parser.add_argument("--list", action="store_true",
                        help="list the variants: port, layout, upstream file and commit, current or archived upstream")
    parser.add_argument("--explain", action="store_true",
                        help="with VARIANT: every difference from upstream's compose file and the transform behind it")
    parser.add_argument("--audit", action="store_true",
                        help="every variant's count of differences from upstream; exit 1 if any is unexplained")
    parser.set_defaults(func=_cmd_render)
    return parser

