#!/usr/bin/python3
"""Stand-in for the docker CLI (package docker-ce-cli).

Talks to the stand-in dockerd over /var/run/docker.sock (DOCKER_HOST honoured), so a stopped daemon or a
user outside the docker group get the real CLI's errors. Every call is appended to
/var/log/docker-standin/calls.log as one JSON line (tests read it).

Commands: version, info, pull, images / image ls|inspect|rm|prune, rmi, run, ps / container ls, inspect,
logs, start, stop, restart, rm, and CLI plugins (`docker compose ...` runs
/usr/libexec/docker/cli-plugins/docker-compose like the real CLI does). `--format` takes Go templates
(see gotemplate.py), `json` and `table ...`.
"""

from __future__ import annotations

import json
import os
import sys
import time

import common
import dockerclient as dc
import gotemplate

TYPE_CHECKING = False  # typing's own flag, without importing typing
if TYPE_CHECKING:
    from typing import Any

HERE = os.path.dirname(os.path.realpath(__file__))
LOG = "/var/log/docker-standin/calls.log"
PLUGIN_DIRS = ("/usr/local/lib/docker/cli-plugins", "/usr/local/libexec/docker/cli-plugins",
               "/usr/lib/docker/cli-plugins", "/usr/libexec/docker/cli-plugins")


class Usage(Exception):
    pass


def meta() -> dict[str, str]:
    return common.read_json(os.path.join(HERE, "version.json"), {}) or {}


def err(msg: str) -> None:
    sys.stderr.write(msg if msg.endswith("\n") else msg + "\n")


def human_size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000:
            return f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}PB"


def parse(args: list[str], value_flags: set[str], bool_flags: set[str]) -> tuple[dict[str, list[str]], list[str]]:
    """Docker-style flags until the first positional (flags after it belong to the command run)."""
    opts: dict[str, list[str]] = {}
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            return opts, args[i + 1:]
        if not a.startswith("-") or a == "-":
            return opts, args[i:]
        name, eq, value = a.partition("=")
        if name in value_flags:
            if not eq:
                i += 1
                if i >= len(args):
                    raise Usage(f"flag needs an argument: {name}")
                value = args[i]
            opts.setdefault(name, []).append(value)
        elif name in bool_flags:
            opts.setdefault(name, []).append(value or "true")
        elif not a.startswith("--") and len(a) > 2 and all(f"-{ch}" in bool_flags for ch in a[1:]):
            for ch in a[1:]:
                opts.setdefault(f"-{ch}", []).append("true")
        else:
            raise Usage(f"unknown flag: {name}")
        i += 1
    return opts, []


def first(opts: dict[str, list[str]], *names: str) -> str | None:
    for n in names:
        if n in opts:
            return opts[n][-1]
    return None


def render_format(fmt: str, items: list[dict[str, Any]], type_name: str, headers: dict[str, str] | None = None) -> str:
    if fmt == "json":
        return "".join(gotemplate.to_json(i) + "\n" for i in items)
    if fmt.startswith("table") and headers is not None:
        return gotemplate.render_table(fmt, items, headers, type_name)
    return "".join(gotemplate.render(fmt, i, type_name) + "\n" for i in items)


# --- version / info ------------------------------------------------------------------------------


def client_version() -> dict[str, Any]:
    m = meta()
    return {"Platform": {"Name": "Docker Engine - Community"}, "Version": m.get("version", "28.5.2"),
            "ApiVersion": m.get("api", "1.51"), "DefaultAPIVersion": m.get("api", "1.51"),
            "GitCommit": m.get("git_commit", "")[:7], "GoVersion": m.get("go", ""), "Os": "linux", "Arch": "amd64",
            "BuildTime": m.get("build_time", ""), "Context": "default"}


def cmd_version(args: list[str]) -> int:
    opts, _ = parse(args, {"--format", "-f"}, set())
    client = client_version()
    try:
        server = dc.rpc("version")
        error = None
    except dc.DaemonDown as exc:
        server, error = None, str(exc)
    fmt = first(opts, "--format", "-f")
    if fmt:
        try:
            sys.stdout.write(render_format(fmt, [{"Client": client, "Server": server}], "types.VersionResponse"))
        except gotemplate.TemplateError as exc:
            err(str(exc))
            return 1
    else:
        print(f"Client: Docker Engine - Community\n Version:           {client['Version']}\n"
              f" API version:       {client['ApiVersion']}\n Go version:        {client['GoVersion']}\n"
              f" Git commit:        {client['GitCommit']}\n Built:             {client['BuildTime']}\n"
              f" OS/Arch:           linux/amd64\n Context:           default")
        if server:
            eng = server["Components"][0]
            print(f"\nServer: Docker Engine - Community\n Engine:\n  Version:          {server['Version']}\n"
                  f"  API version:      {server['ApiVersion']} (minimum version {server['MinAPIVersion']})\n"
                  f"  Go version:       {server['GoVersion']}\n  Git commit:       {server['GitCommit'][:7]}\n"
                  f"  Built:            {server['BuildTime']}\n  OS/Arch:          linux/amd64\n  Experimental:     "
                  f"{eng['Details']['Experimental']}")
            for comp in server["Components"][1:]:
                print(f" {comp['Name']}:\n  Version:          {comp['Version']}\n"
                      f"  GitCommit:        {comp['Details']['GitCommit']}")
    if error:
        err(error)
        return 1
    return 0


def plugins() -> list[dict[str, str]]:
    found = []
    seen = set()
    dirs = [os.path.join(os.path.expanduser("~"), ".docker/cli-plugins")] + [common.spath(d) for d in PLUGIN_DIRS]
    for d in dirs:
        if not os.path.isdir(d):
            continue
        for f in sorted(os.path.join(d, n) for n in os.listdir(d) if n.startswith("docker-")):
            name = os.path.basename(f)[len("docker-"):]
            if name in seen or not os.access(f, os.X_OK):
                continue
            seen.add(name)
            meta_ = {}
            try:
                import subprocess

                out = subprocess.run([str(f), "docker-cli-plugin-metadata"], capture_output=True, text=True, timeout=20)
                meta_ = json.loads(out.stdout)
            except (OSError, ValueError):
                pass
            found.append({"Name": name, "Path": str(f), "Version": meta_.get("Version", ""),
                          "ShortDescription": meta_.get("ShortDescription", ""), "Vendor": meta_.get("Vendor", "")})
    return found


def cmd_info(args: list[str]) -> int:
    opts, _ = parse(args, {"--format", "-f"}, set())
    fmt = first(opts, "--format", "-f")
    try:
        info = dc.rpc("info")
        error = None
    except dc.DaemonDown as exc:
        info, error = None, str(exc)
    if fmt:
        if info is None:
            err(error or "")
            return 1
        info = {k: v for k, v in info.items() if k != "standin"}
        try:
            sys.stdout.write(render_format(fmt, [info], "system.Info"))
        except gotemplate.TemplateError as exc:
            err(str(exc))
            return 1
        return 0
    client = client_version()
    out = [f"Client: Docker Engine - Community\n Version:    {client['Version']}\n Context:    default\n"
           " Debug Mode: false\n Plugins:"]
    for p in plugins():
        out.append(f"  {p['Name']}: {p['ShortDescription']} ({p['Vendor']})\n    Version:  {p['Version']}\n"
                   f"    Path:     {p['Path']}")
    out.append("")
    print("\n".join(out))
    if info is None:
        print("Server:")
        err(f"ERROR: {error}\nerrors pretty printing info")
        return 1
    runtimes = " ".join(sorted(info["Runtimes"]))
    lines = [
        "Server:", f" Containers: {info['Containers']}", f"  Running: {info['ContainersRunning']}",
        f"  Paused: {info['ContainersPaused']}", f"  Stopped: {info['ContainersStopped']}",
        f" Images: {info['Images']}", f" Server Version: {info['ServerVersion']}",
        f" Storage Driver: {info['Driver']}",
    ] + [f"  {k}: {v}" for k, v in info["DriverStatus"]] + [
        f" Logging Driver: {info['LoggingDriver']}", f" Cgroup Driver: {info['CgroupDriver']}",
        f" Cgroup Version: {info['CgroupVersion']}", " Plugins:",
        f"  Volume: {' '.join(info['Plugins']['Volume'])}", f"  Network: {' '.join(info['Plugins']['Network'])}",
        f"  Log: {' '.join(info['Plugins']['Log'])}", " CDI spec directories:",
    ] + [f"  {d}" for d in info["CDISpecDirs"]] + [
        " Swarm: inactive", f" Runtimes: {runtimes}", f" Default Runtime: {info['DefaultRuntime']}",
        f" Init Binary: {info['InitBinary']}", f" containerd version: {info['ContainerdCommit']['ID']}",
        f" runc version: {info['RuncCommit']['ID']}", f" init version: {info['InitCommit']['ID']}",
        " Security Options:", "  seccomp", "   Profile: builtin", "  cgroupns",
        f" Kernel Version: {info['KernelVersion']}", f" Operating System: {info['OperatingSystem']}",
        f" OSType: {info['OSType']}", f" Architecture: {info['Architecture']}", f" CPUs: {info['NCPU']}",
        f" Total Memory: {info['MemTotal'] / 2**30:.2f}GiB", f" Name: {info['Name']}", f" ID: {info['ID']}",
        f" Docker Root Dir: {info['DockerRootDir']}", f" Debug Mode: {str(info['Debug']).lower()}",
        f" Experimental: {str(info['ExperimentalBuild']).lower()}", " Insecure Registries:",
    ] + [f"  {c}" for c in info["RegistryConfig"]["InsecureRegistryCIDRs"]]
    if info["RegistryConfig"]["Mirrors"]:
        lines += [" Registry Mirrors:"] + [f"  {m}" for m in info["RegistryConfig"]["Mirrors"]]
    lines.append(f" Live Restore Enabled: {str(info['LiveRestoreEnabled']).lower()}")
    print("\n".join(lines) + "\n")
    return 0


# --- images ------------------------------------------------------------------------------------


def cmd_pull(args: list[str]) -> int:
    opts, rest = parse(args, {"--platform"}, {"-q", "--quiet", "-a", "--all-tags", "--disable-content-trust"})
    if len(rest) != 1:
        raise Usage('"docker pull" requires exactly 1 argument.')
    try:
        result = dc.rpc("pull", ref=rest[0])
    except dc.DaemonError as exc:
        err(f"Error response from daemon: {exc}")
        return 1
    lines = result["lines"]
    sys.stdout.write((lines[-1] + "\n") if ("-q" in opts or "--quiet" in opts) else "\n".join(lines) + "\n")
    return 0


def image_rows(images: list[dict[str, Any]], digests: bool) -> list[dict[str, Any]]:
    rows = []
    for img in images:
        tags = img["RepoTags"] or (
            [f"{img['RepoDigests'][0].split('@')[0]}:<none>"] if img["RepoDigests"] else ["<none>:<none>"])
        for tag in tags:
            repo, _, t = tag.rpartition(":")
            digest = next((d.split("@")[1] for d in img["RepoDigests"] if d.split("@")[0] == repo), "<none>")
            rows.append({"Repository": repo, "Tag": t, "ID": img["Id"][7:19], "Digest": digest,
                         "CreatedAt": img["Created"], "CreatedSince": age(img["Created"]),
                         "Size": human_size(img["Size"]), "Containers": "N/A"})
    return rows


def cmd_images(args: list[str]) -> int:
    opts, rest = parse(args, {"--format", "--filter", "-f"}, {"-q", "--quiet", "-a", "--all", "--digests", "--no-trunc"})
    images = dc.rpc("images")
    rows = image_rows(images, "--digests" in opts)
    if rest:
        want = rest[0]
        rows = [r for r in rows if r["Repository"] == want or f"{r['Repository']}:{r['Tag']}" == want]
    if "-q" in opts or "--quiet" in opts:
        sys.stdout.write("".join(sorted({r["ID"] + "\n" for r in rows})))
        return 0
    fmt = first(opts, "--format") or ("table {{.Repository}}\t{{.Tag}}\t{{.Digest}}\t{{.ID}}\t{{.CreatedSince}}\t{{.Size}}"
                                      if "--digests" in opts else
                                      "table {{.Repository}}\t{{.Tag}}\t{{.ID}}\t{{.CreatedSince}}\t{{.Size}}")
    sys.stdout.write(render_format(fmt, rows, "formatter.imageContext",
                                   {"Repository": "REPOSITORY", "Tag": "TAG", "ID": "IMAGE ID", "Digest": "DIGEST",
                                    "CreatedSince": "CREATED", "Size": "SIZE", "CreatedAt": "CREATED AT"}))
    return 0


def cmd_image(args: list[str]) -> int:
    sub, rest = (args[0], args[1:]) if args else ("", [])
    if sub in ("ls", "list"):
        return cmd_images(rest)
    if sub == "inspect":
        return cmd_inspect(rest, only="image")
    if sub in ("rm", "remove"):
        return cmd_rmi(rest)
    if sub == "pull":
        return cmd_pull(rest)
    if sub == "prune":
        opts, _ = parse(rest, {"--filter"}, {"-a", "--all", "-f", "--force"})
        used = {c["ImageID"] for c in dc.rpc("containers", all=True)}
        deleted = []
        for img in dc.rpc("images"):
            if img["Id"] in used or (img["RepoTags"] and "-a" not in opts and "--all" not in opts):
                continue
            deleted += dc.rpc("image_remove", ref=img["Id"], force=False)
        if deleted:
            print("Deleted Images:\n" + "\n".join(deleted) + "\n")
        print("Total reclaimed space: 0B")
        return 0
    raise Usage(f"docker image: '{sub}' is not a docker command.")


def cmd_rmi(args: list[str]) -> int:
    opts, rest = parse(args, set(), {"-f", "--force", "--no-prune"})
    code = 0
    for name in rest:
        try:
            for line in dc.rpc("image_remove", ref=name, force="-f" in opts or "--force" in opts):
                print(line)
        except dc.DaemonError as exc:
            err(f"Error response from daemon: {exc}")
            code = 1
    return code


# --- containers ----------------------------------------------------------------------------------


def parse_ports(values: list[str]) -> list[dict[str, Any]]:
    out = []
    for v in values:
        spec, _, proto = v.partition("/")
        parts = spec.rsplit(":", 2)
        if len(parts) == 3:
            host_ip, host_port, ctr = parts
        elif len(parts) == 2:
            host_ip, (host_port, ctr) = "", parts
        else:
            raise Usage(f"the rigup stand-in needs an explicit host port: -p {v}")
        out.append({"host_ip": host_ip.strip("[]"), "host_port": int(host_port), "container_port": int(ctr),
                    "proto": proto or "tcp"})
    return out


def parse_gpus(value: str) -> dict[str, Any]:
    req: dict[str, Any] = {"driver": "", "count": 0, "device_ids": [], "capabilities": [["gpu"]]}
    value = value.strip().strip('"').strip("'")
    if value == "all":
        req["count"] = -1
        return req
    if value.isdigit():
        req["count"] = int(value)
        return req
    for part in value.split(","):
        k, _, v = part.partition("=")
        if k == "device":
            req["device_ids"].append(v.strip('"'))
        elif k == "count":
            req["count"] = -1 if v == "all" else int(v)
        elif k == "driver":
            req["driver"] = v
        elif not _ and req["device_ids"]:
            req["device_ids"].append(k.strip('"'))  # the tail of device=0,1
        else:
            raise Usage(f'invalid argument "{value}" for "--gpus" flag')
    return req


def parse_volumes(values: list[str]) -> list[dict[str, Any]]:
    out = []
    for v in values:
        parts = v.split(":")
        if len(parts) < 2:
            continue  # anonymous volume
        src, dst = parts[0], parts[1]
        if not src.startswith("/"):
            src = f"/var/lib/docker/volumes/{src}/_data"
        out.append({"source": src, "target": dst, "read_only": len(parts) > 2 and "ro" in parts[2].split(","),
                    "create_host_path": True})
    return out


def parse_mounts(values: list[str]) -> list[dict[str, Any]]:
    """--mount type=bind,source=...,target=...[,readonly]: a missing source fails the create (no host path made)."""
    out = []
    for v in values:
        opts = dict(p.partition("=")[::2] for p in v.split(","))
        if opts.get("type", "volume") not in ("bind", "volume"):
            continue
        src = opts.get("source") or opts.get("src") or ""
        dst = opts.get("target") or opts.get("destination") or opts.get("dst") or ""
        if not src or not dst:
            continue
        bind = opts.get("type") == "bind"
        if not bind:
            src = f"/var/lib/docker/volumes/{src}/_data"
        ro = "readonly" in opts and opts["readonly"] in ("", "true", "1") or "ro" in opts and opts["ro"] in ("", "true", "1")
        out.append({"source": src, "target": dst, "read_only": ro, "create_host_path": not bind})
    return out


RUN_VALUE_FLAGS = {"--name", "-e", "--env", "--env-file", "-p", "--publish", "-v", "--volume", "--gpus", "--runtime",
                   "--entrypoint", "--restart", "--network", "--net", "--ipc", "--shm-size", "-w", "--workdir", "-l",
                   "--label", "-u", "--user", "--pull", "--platform", "--health-cmd", "--health-interval",
                   "--health-retries", "--health-timeout", "--health-start-period", "--ulimit", "--cap-add",
                   "--device", "-h", "--hostname", "--add-host", "-m", "--memory", "--cpus", "--log-driver",
                   "--log-opt", "--mount", "--security-opt", "--stop-timeout"}
RUN_BOOL_FLAGS = {"-d", "--detach", "--rm", "-i", "--interactive", "-t", "--tty", "--privileged", "--init", "-q",
                  "--quiet", "-P", "--publish-all", "--read-only", "--no-healthcheck"}


def ensure_image(name: str, quiet: bool, policy: str = "missing") -> bool:
    try:
        dc.rpc("image_inspect", ref=name)
        if policy != "always":
            return True
    except dc.DaemonError:
        if policy == "never":
            err(f"docker: Error response from daemon: No such image: {dc.familiar(name)}")
            return False
        err(f"Unable to find image '{dc.familiar(name)}' locally")
    try:
        result = dc.rpc("pull", ref=name)
    except dc.DaemonError as exc:
        err(f"docker: Error response from daemon: {exc}\n\nRun 'docker run --help' for more information")
        return False
    if not quiet:
        err("\n".join(result["lines"][:-1]))
    return True


def cmd_run(args: list[str]) -> int:
    from pathlib import Path  # here, not at the top: the reads a fact batch makes need none

    opts, rest = parse(args, RUN_VALUE_FLAGS, RUN_BOOL_FLAGS)
    if not rest:
        raise Usage('"docker run" requires at least 1 argument.')
    image, cmd = rest[0], rest[1:]
    env: dict[str, str] = {}
    for f in opts.get("--env-file", []):
        for line in Path(f).read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                k, _, v = line.partition("=")
                env[k.strip()] = v
    for e in opts.get("-e", []) + opts.get("--env", []):
        k, eq, v = e.partition("=")
        env[k] = v if eq else os.environ.get(k, "")
    labels = dict(l.partition("=")[::2] for l in opts.get("-l", []) + opts.get("--label", []))
    gpus = first(opts, "--gpus")
    entry = first(opts, "--entrypoint")
    hc = None
    if first(opts, "--health-cmd"):
        hc = {"test": ["CMD-SHELL", first(opts, "--health-cmd")], "interval": first(opts, "--health-interval"),
              "retries": first(opts, "--health-retries"), "timeout": first(opts, "--health-timeout"),
              "start_period": first(opts, "--health-start-period")}
    spec = {
        "name": first(opts, "--name"), "image": image, "cmd": cmd or None,
        "entrypoint": ([entry] if entry else []) if entry is not None else None, "env": env, "labels": labels,
        "ports": parse_ports(opts.get("-p", []) + opts.get("--publish", [])),
        "restart": first(opts, "--restart"), "gpus": parse_gpus(gpus) if gpus else None,
        "runtime": first(opts, "--runtime"), "network_mode": first(opts, "--network", "--net"),
        "binds": parse_volumes(opts.get("-v", []) + opts.get("--volume", [])) + parse_mounts(opts.get("--mount", [])),
        "healthcheck": hc,
        "auto_remove": "--rm" in opts, "ipc": first(opts, "--ipc"), "working_dir": first(opts, "-w", "--workdir"),
    }
    quiet = "-q" in opts or "--quiet" in opts
    if not ensure_image(image, quiet, first(opts, "--pull") or "missing"):
        return 125
    try:
        cid = dc.rpc("create", spec=spec)["Id"]
    except dc.DaemonError as exc:
        err(f"docker: Error response from daemon: {exc}\n\nRun 'docker run --help' for more information")
        return 125
    try:
        dc.rpc("start", name=cid)
    except dc.DaemonError as exc:
        err(f"docker: Error response from daemon: {exc}\n\nRun 'docker run --help' for more information")
        if "--rm" in opts:
            dc.rpc("remove", name=cid, force=True)
        text = str(exc)
        if "error during container init: exec" in text:  # the entrypoint itself: missing 127, not runnable 126
            return 127 if "executable file not found" in text or "no such file or directory" in text else 126
        return 125
    if "-d" in opts or "--detach" in opts:
        print(cid)
        return 0
    code = dc.rpc("wait", name=cid, timeout=24 * 3600)["StatusCode"]
    sys.stdout.write(dc.rpc("logs", name=cid)["text"])
    if "--rm" in opts:
        dc.rpc("remove", name=cid, force=True)
    return int(code)


def ports_text(ports: list[dict[str, Any]]) -> str:
    return ", ".join(f"{p.get('host_ip') or '0.0.0.0'}:{p['host_port']}->{p['container_port']}/{p.get('proto', 'tcp')}"
                     for p in ports)


def age(iso: str) -> str:
    """'About a minute ago' style age of an RFC 3339 UTC timestamp."""
    import calendar

    try:
        seconds = time.time() - calendar.timegm(time.strptime(iso[:19], "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return "Unknown"
    if seconds < 60:
        return f"{max(1, int(seconds))} second{'s' if int(seconds) > 1 else ''} ago"
    if seconds < 120:
        return "About a minute ago"
    if seconds < 3600:
        return f"{int(seconds // 60)} minutes ago"
    if seconds < 7200:
        return "About an hour ago"
    return f"{int(seconds // 3600)} hours ago"


def ps_rows(items: list[dict[str, Any]], no_trunc: bool, with_age: bool = True) -> list[dict[str, Any]]:
    """`docker ps` rows; with_age False leaves RunningFor empty (a format that does not print it: the
    age's date parsing is most of a `docker ps --format '{{.Names}}'`)."""
    rows = []
    for c in items:
        command = c["Command"] if no_trunc or len(c["Command"]) <= 20 else c["Command"][:19] + "…"
        rows.append({"ID": c["Id"] if no_trunc else c["Id"][:12], "Image": c["Image"], "Command": f'"{command}"',
                     "CreatedAt": c["Created"], "RunningFor": age(c["Created"]) if with_age else "",
                     "Ports": ports_text(c["Ports"]) if c["State"] == "running" else "",
                     "State": c["State"], "Status": c["Status"], "Size": "0B", "Names": c["Names"][0].lstrip("/"),
                     "Labels": ",".join(f"{k}={v}" for k, v in sorted(c["Labels"].items())), "Mounts": "",
                     "Networks": "bridge", "LocalVolumes": "0"})
    return rows


def match_filters(c: dict[str, Any], filters: list[str]) -> bool:
    for f in filters:
        k, _, v = f.partition("=")
        if k == "name" and v not in c["Names"][0]:
            return False
        if k == "label":
            lk, eq, lv = v.partition("=")
            if lk not in c["Labels"] or (eq and c["Labels"][lk] != lv):
                return False
        if k == "status" and c["State"] != v:
            return False
        if k == "ancestor" and c["Image"] != v:
            return False
    return True


def cmd_ps(args: list[str]) -> int:
    opts, _ = parse(args, {"--format", "--filter", "-f", "-n", "--last"},
                    {"-a", "--all", "-q", "--quiet", "--no-trunc", "-s", "--size", "-l", "--latest"})
    items = dc.rpc("containers", all="-a" in opts or "--all" in opts)
    items = [c for c in items if match_filters(c, opts.get("--filter", []) + opts.get("-f", []))]
    quiet = "-q" in opts or "--quiet" in opts
    fmt = first(opts, "--format") or "table {{.ID}}\t{{.Image}}\t{{.Command}}\t{{.RunningFor}}\t{{.Status}}\t{{.Ports}}\t{{.Names}}"
    whole_row = "json" in fmt or "{{.}}" in fmt.replace(" ", "")
    rows = ps_rows(items, "--no-trunc" in opts, with_age=not quiet and ("RunningFor" in fmt or whole_row))
    if quiet:
        sys.stdout.write("".join(r["ID"] + "\n" for r in rows))
        return 0
    sys.stdout.write(render_format(fmt, rows, "formatter.ContainerContext",
                                   {"ID": "CONTAINER ID", "Image": "IMAGE", "Command": "COMMAND", "RunningFor": "CREATED",
                                    "Status": "STATUS", "Ports": "PORTS", "Names": "NAMES", "State": "STATE",
                                    "CreatedAt": "CREATED AT", "Labels": "LABELS"}))
    return 0


def cmd_inspect(args: list[str], only: str | None = None) -> int:
    opts, rest = parse(args, {"--format", "-f", "--type"}, {"-s", "--size"})
    kind = only or first(opts, "--type")
    fmt = first(opts, "--format", "-f")
    found, code = [], 0
    for name in rest:
        obj = None
        if kind in (None, "container"):
            try:
                obj = dc.rpc("inspect", name=name)
            except dc.DaemonError:
                obj = None
        if obj is None and kind in (None, "image"):
            try:
                obj = dc.rpc("image_inspect", ref=name)
            except dc.DaemonError:
                obj = None
        if obj is None:
            what = {"image": "image", "container": "container"}.get(kind or "", "object")
            err(f"Error response from daemon: No such {what}: {name}" if kind else f"Error: No such object: {name}")
            code = 1
            continue
        found.append(obj)
    try:
        if fmt:
            sys.stdout.write(render_format(fmt, found, "types.ContainerJSON"))
        else:
            sys.stdout.write(json.dumps(found, indent=4) + "\n")
    except gotemplate.TemplateError as exc:
        err(str(exc))
        return 1
    return code


def cmd_logs(args: list[str]) -> int:
    opts, rest = parse(args, {"--tail", "-n", "--since", "--until"}, {"-f", "--follow", "-t", "--timestamps", "--details"})
    if len(rest) != 1:
        raise Usage('"docker logs" requires exactly 1 argument.')
    tail = first(opts, "--tail", "-n")
    tail_n = None if tail in (None, "all") else int(tail)
    try:
        text = dc.rpc("logs", name=rest[0], tail=tail_n)["text"]
    except dc.DaemonError as exc:
        err(f"Error response from daemon: {exc}")
        return 1
    sys.stdout.write(text)
    if "-f" in opts or "--follow" in opts:
        seen = len(dc.rpc("logs", name=rest[0])["text"])
        while True:
            c = dc.rpc("inspect", name=rest[0])
            full = dc.rpc("logs", name=rest[0])["text"]
            sys.stdout.write(full[seen:])
            sys.stdout.flush()
            seen = len(full)
            if not c["State"]["Running"] and not c["State"]["Restarting"]:
                return 0
            time.sleep(0.5)
    return 0


def cmd_simple(verb: str, args: list[str]) -> int:
    opts, rest = parse(args, {"-t", "--time", "--timeout", "-s", "--signal"}, {"-f", "--force", "-v", "--volumes", "-a", "-i"})
    if not rest:
        raise Usage(f'"docker {verb}" requires at least 1 argument.')
    code = 0
    for name in rest:
        try:
            if verb in ("stop", "restart"):
                dc.rpc("stop", name=name, timeout=float(first(opts, "-t", "--time", "--timeout") or 10))
            if verb in ("start", "restart"):
                dc.rpc("start", name=name)
            if verb == "rm":
                dc.rpc("remove", name=name, force="-f" in opts or "--force" in opts)
            print(name)
        except dc.DaemonError as exc:
            err(f"Error response from daemon: {exc}")
            code = 1
    return code


def run_plugin(name: str, args: list[str]) -> int:
    from pathlib import Path  # here, not at the top: the reads a fact batch makes need none

    dirs = [Path.home() / ".docker/cli-plugins"] + [common.path(d) for d in PLUGIN_DIRS]
    for d in dirs:
        p = d / f"docker-{name}"
        if p.exists() and os.access(p, os.X_OK):
            env = dict(os.environ, DOCKER_CLI_PLUGIN_ORIGINAL_CLI_COMMAND=sys.argv[0])
            os.execve(str(p), [str(p), name, *args], env)
    err(f"docker: unknown command: docker {name}\n\nRun 'docker --help' for more information")
    return 1


def main(argv: list[str]) -> int:
    common.log_call(LOG, "docker", argv)
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        a = argv[i]
        if a in ("-v", "--version"):
            m = meta()
            print(f"Docker version {m.get('version', '28.5.2')}, build {m.get('git_commit', '')[:7]}")
            return 0
        if a in ("-H", "--host"):
            os.environ["DOCKER_HOST"] = argv[i + 1]
            i += 2
            continue
        if a.startswith("--host="):
            os.environ["DOCKER_HOST"] = a.split("=", 1)[1]
        elif a in ("-D", "--debug"):
            pass
        elif a in ("-l", "--log-level", "--context", "-c", "--config"):
            i += 1
        else:
            err(f"unknown flag: {a}\nSee 'docker --help'.")
            return 125
        i += 1
    argv = argv[i:]
    if not argv:
        print("Usage:  docker [OPTIONS] COMMAND\n\n(rigup test-bed stand-in)")
        return 0
    cmd, args = argv[0], argv[1:]
    table = {
        "version": cmd_version, "info": cmd_info, "pull": cmd_pull, "images": cmd_images, "image": cmd_image,
        "rmi": cmd_rmi, "run": cmd_run, "ps": cmd_ps, "inspect": cmd_inspect, "logs": cmd_logs,
        "start": lambda a: cmd_simple("start", a), "stop": lambda a: cmd_simple("stop", a),
        "restart": lambda a: cmd_simple("restart", a), "rm": lambda a: cmd_simple("rm", a),
    }
    if cmd == "container" and args:
        cmd, args = {"ls": "ps", "list": "ps"}.get(args[0], args[0]), args[1:]
    if cmd == "system" and args[:1] == ["info"]:
        cmd, args = "info", args[1:]
    try:
        if cmd in table:
            return table[cmd](args)
        return run_plugin(cmd, args)
    except Usage as exc:
        err(f"{exc}\nSee 'docker {cmd} --help'.")
        return 125 if cmd == "run" else 1
    except dc.DaemonDown as exc:
        err(str(exc))
        return 1
    except dc.DaemonError as exc:
        err(f"Error response from daemon: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
