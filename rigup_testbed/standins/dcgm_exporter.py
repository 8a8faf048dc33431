#!/usr/bin/python3
"""`dcgm-exporter` in the test bed's image of NVIDIA's DCGM exporter (rigup_testbed/registry.py builds
nvcr.io/nvidia/k8s/dcgm-exporter:<dcgm>-<exporter>-ubuntu22.04 with this as /usr/bin/dcgm-exporter,
behind the image's entrypoint script). The facts it follows, with their commits, are in
rigup_testbed/FACTS.md section 12.

  dcgm-exporter [-f FILE] [-a ADDRESS] [-c MS] [-n] [-o] [--replace-blanks-in-model-name] [--web-config-file FILE] [-v]

It reads the GPUs where the real one's DCGM reads NVML: from the driver the container toolkit's hook
mounted into the container, here the GPU stand-in (nvidia-smi's module, its directory mounted with it,
reading the hardware file the hook wrote for this container and the driver's /run state). So:

  * without GPUs (no `--gpus`: no hook, no driver in the container) it fails as the real one does when
    DCGM cannot start: "error starting nv-hostengine: DCGM initialization error", exit 1;
  * it serves GET /metrics on -a (default :9400) in the exporter's format: for each field of the
    counters file (-f, default /etc/dcgm-exporter/default-counters.csv: field, Prometheus type, help),
    `# HELP`/`# TYPE` and one line per GPU labelled gpu, UUID, pci_bus_id, device, modelName, Hostname,
    then the file's `label` fields (DCGM_FI_DRIVER_VERSION) and, for DCGM_FI_DEV_XID_ERRORS, err_code and
    err_msg; integers as integers, doubles with six decimals; a field a GPU does not support is left out
    (DCGM's blank value), as are profiling (DCGM_FI_PROF_*) fields when GPU 0 has no profiling support
    (GeForce before Blackwell), each skipped with the exporter's warning;
  * values are read at each scrape (the real one samples every -c ms; see FACTS.md), so what a test
    injects (nvidia_smi.set_gpu_state: temperature_c, xid, ...) shows at the next scrape;
  * with --web-config-file (DCGM_EXPORTER_WEB_CONFIG_FILE), exporter-toolkit's web config as the real one
    serves it (internal/pkg/server/server.go: web.ListenAndServe): TLS from tls_server_config's cert_file and
    key_file, plain HTTP answered 400 "Client sent an HTTP request to an HTTPS server.", and basic_auth_users
    (bcrypt hashes, checked with the C library's crypt: libxcrypt knows $2b$) asked of every request, 401
    "Unauthorized" with WWW-Authenticate: Basic otherwise. The file is read as the block mappings a YAML
    dumper writes (a top-level key, its indented `key: value` lines); a key exporter-toolkit does not know
    stops it, as its strict YAML reading does.

Standard library only: it runs on the image's Python, like the vLLM image's stand-in.
"""

from __future__ import annotations

import base64
import csv
import hmac
import http.server
import json
import os
import signal
import socket
import ssl
import sys
import threading
import time
import warnings
from typing import Any, Callable, NamedTuple

with warnings.catch_warnings():  # deprecated from Python 3.11, gone in 3.13: the rigs' image has 3.11
    warnings.simplefilter("ignore", DeprecationWarning)
    import crypt

HERE = os.path.dirname(os.path.realpath(__file__))
DEFAULT_COUNTERS = "/etc/dcgm-exporter/default-counters.csv"
NVIDIA_SMI = "/usr/bin/nvidia-smi"  # the hook mounts the driver's tools here (ctk.py)
PROCS_DIR = "/run/nvidia-standin/procs"
APP_NAME = "DCGM Exporter"

# XID error texts the exporter puts in err_msg (dcgm-exporter internal/pkg/collector/xid_errors.go): the
# codes a test bed injects; any other code is "Unknown Error" here
XID_TEXT = {
    0: "No Error", 13: "Graphics Engine Exception", 31: "GPU memory page fault", 43: "GPU stopped processing",
    45: "Preemptive cleanup, due to previous errors -- Most likely to see when running multiple cuda",
    48: "Double Bit ECC Error", 61: "Internal micro-controller breakpoint/warning",
    62: "Internal micro-controller halt", 63: "ECC page retirement or row remapping recording event",
    64: "ECC page retirement or row remapper recording failure", 74: "NVLINK Error", 79: "GPU has fallen off the bus",
    92: "High single-bit ECC error rate", 94: "Contained ECC error", 95: "Uncontained ECC error",
    119: "GSP RPC Timeout", 120: "GSP Error",
}


class Field(NamedTuple):
    """A DCGM field the stand-in can report: its DCGM value type (i: INT64, d: DOUBLE, s: STRING), the
    Prometheus type and help its line in the default counters file carries (None: not in that file's
    enabled lines), and how to read it from a GPU (None: the GPU does not support it)."""

    name: str
    kind: str
    prom: str | None
    help: str
    read: Callable[[Any, dict[str, Any]], Any]


FIELDS: list[Field] = [
    # the default counters file's enabled lines, in its order (etc/default-counters.csv)
    Field("DCGM_FI_DEV_SM_CLOCK", "i", "gauge", "SM clock (MHz).", lambda g, c: g.sm_clock),
    Field("DCGM_FI_DEV_MEM_CLOCK", "i", "gauge", "Memory clock (MHz).", lambda g, c: g.mem_clock),
    Field("DCGM_FI_DEV_MEMORY_TEMP", "i", "gauge", "Memory temperature (degrees C).", lambda g, c: g.memory_temperature),
    Field("DCGM_FI_DEV_GPU_TEMP", "i", "gauge", "GPU temperature (degrees C).", lambda g, c: g.temperature),
    Field("DCGM_FI_DEV_POWER_USAGE", "d", "gauge", "Power drawn (W).", lambda g, c: g.power_draw),
    Field("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "i", "counter", "Energy used since boot (mJ).",
          lambda g, c: int(g.power_draw * c["uptime_s"] * 1000)),
    Field("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "i", "counter", "PCIe retries in total.", lambda g, c: 0),
    Field("DCGM_FI_DEV_GPU_UTIL", "i", "gauge", "GPU utilisation (%).", lambda g, c: g.utilization),
    Field("DCGM_FI_DEV_MEM_COPY_UTIL", "i", "gauge", "Memory utilisation (%).", lambda g, c: g.utilization_memory),
    Field("DCGM_FI_DEV_ENC_UTIL", "i", "gauge", "Encoder utilisation (%).", lambda g, c: 0),
    Field("DCGM_FI_DEV_DEC_UTIL", "i", "gauge", "Decoder utilisation (%).", lambda g, c: 0),
    Field("DCGM_FI_DEV_XID_ERRORS", "i", "gauge", "The last XID error seen.", lambda g, c: g.xid),
    Field("DCGM_FI_DEV_FB_FREE", "i", "gauge", "Framebuffer memory free (MiB).", lambda g, c: g.free),
    Field("DCGM_FI_DEV_FB_USED", "i", "gauge", "Framebuffer memory used (MiB).", lambda g, c: g.used),
    Field("DCGM_FI_DEV_FB_RESERVED", "i", "gauge", "Framebuffer memory reserved (MiB).", lambda g, c: g.reserved),
    Field("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "i", "counter", "NVLink bandwidth counters of all lanes in total.",
          lambda g, c: 0),
    Field("DCGM_FI_DEV_VGPU_LICENSE_STATUS", "i", "gauge", "vGPU licence status.", lambda g, c: 0),
    # row remapping is an HBM feature: a GeForce card's NVML answers "not supported"
    Field("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "i", "counter", "Rows remapped for uncorrectable errors.",
          lambda g, c: None if g.geforce else 0),
    Field("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "i", "counter", "Rows remapped for correctable errors.",
          lambda g, c: None if g.geforce else 0),
    Field("DCGM_FI_DEV_ROW_REMAP_FAILURE", "i", "gauge", "Whether row remapping failed.",
          lambda g, c: None if g.geforce else 0),
    Field("DCGM_FI_DRIVER_VERSION", "s", "label", "Driver version.", lambda g, c: c["driver"]),
    Field("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "d", "gauge", "Share of time the graphics engine is active.",
          lambda g, c: g.utilization / 100),
    Field("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "d", "gauge", "Share of cycles the tensor (HMMA) pipe is active.",
          lambda g, c: 0.0),
    Field("DCGM_FI_PROF_DRAM_ACTIVE", "d", "gauge", "Share of cycles the device memory interface moves data.",
          lambda g, c: g.utilization_memory / 100),
    Field("DCGM_FI_PROF_PCIE_TX_BYTES", "i", "gauge", "PCIe transmit rate with headers and payload (bytes/s).",
          lambda g, c: 0),
    Field("DCGM_FI_PROF_PCIE_RX_BYTES", "i", "gauge", "PCIe receive rate with headers and payload (bytes/s).",
          lambda g, c: 0),
    # fields a counters file of one's own may name (off in the default file)
    Field("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "i", None, "Why the clocks are held down (bitmask).",
          lambda g, c: g.clocks_event_reasons),
    Field("DCGM_FI_DEV_POWER_MGMT_LIMIT", "d", None, "Power management limit (W).", lambda g, c: g.power_limit),
    Field("DCGM_FI_DEV_FB_TOTAL", "i", None, "Framebuffer memory in total (MiB).", lambda g, c: g.total),
    Field("DCGM_FI_NVML_VERSION", "s", None, "NVML version.", lambda g, c: c["nvml"]),
    Field("DCGM_FI_DEV_VBIOS_VERSION", "s", None, "VBIOS version.", lambda g, c: g.get("vbios_version", "94.02.42.00.A9")),
    Field("DCGM_FI_DEV_SERIAL", "s", None, "Serial number.", lambda g, c: None if g.geforce else g.get("serial", "1650000000000")),
]
BY_NAME = {f.name: f for f in FIELDS}


def default_counters_csv() -> str:
    """The image's /etc/dcgm-exporter/default-counters.csv: the enabled lines of the real file, in its
    order, with help texts of our own."""
    lines = ["# The test bed's copy of dcgm-exporter's etc/default-counters.csv (rigup_testbed/FACTS.md section 12):",
             "# the same fields and Prometheus types in the same order; help texts are the test bed's.",
             "# Format: DCGM field, Prometheus type, help message", ""]
    lines += [f"{f.name}, {f.prom}, {f.help}" for f in FIELDS if f.prom is not None]
    return "\n".join(lines) + "\n"


# --- logging as the exporter's slog text handler writes it ------------------------------------------


def _quote(value: str) -> str:
    if value and not any(ch in value for ch in ' ="\\\n\t') and value.isprintable():
        return value
    return json.dumps(value)


def log(level: str, msg: str, **attrs: object) -> None:
    now = time.time()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}Z"
    extra = "".join(f" {k}={_quote(str(v))}" for k, v in attrs.items())
    sys.stderr.write(f"time={stamp} level={level} msg={_quote(msg)}{extra}\n")
    sys.stderr.flush()


# --- the command line (urfave/cli v2: -f/--collectors, -a/--address, ... and their environment variables)


def version() -> str:
    try:
        with open(os.path.join(HERE, "dcgm-exporter.json")) as fh:
            return str(json.load(fh)["version"])
    except (OSError, ValueError, KeyError):
        return "4.5.3-4.8.2"


FLAGS = {  # name: (aliases, takes a value, environment variable)
    "collectors": (("f",), True, "DCGM_EXPORTER_COLLECTORS"),
    "address": (("a",), True, "DCGM_EXPORTER_LISTEN"),
    "collect-interval": (("c",), True, "DCGM_EXPORTER_INTERVAL"),
    "no-hostname": (("n",), False, "DCGM_EXPORTER_NO_HOSTNAME"),
    "use-old-namespace": (("o",), False, "DCGM_EXPORTER_USE_OLD_NAMESPACE"),
    "replace-blanks-in-model-name": (("rbmn",), False, "DCGM_EXPORTER_REPLACE_BLANKS_IN_MODEL_NAME"),
    "kubernetes": (("k",), False, "DCGM_EXPORTER_KUBERNETES"),
    "debug": ((), False, "DCGM_EXPORTER_DEBUG"),
    "web-config-file": ((), True, "DCGM_EXPORTER_WEB_CONFIG_FILE"),
}
DEFAULTS = {"collectors": DEFAULT_COUNTERS, "address": ":9400", "collect-interval": "30000"}


def parse(argv: list[str]) -> dict[str, Any]:
    names = {n: n for n in FLAGS} | {a: n for n, (aliases, _, _) in FLAGS.items() for a in aliases}
    opts: dict[str, Any] = dict(DEFAULTS)
    for name, (_, takes, env) in FLAGS.items():
        if env in os.environ:
            opts[name] = os.environ[env] if takes else os.environ[env].lower() in ("1", "true", "t")
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-v", "--version"):
            print(f"{APP_NAME} version {version()}")
            raise SystemExit(0)
        if arg in ("-h", "--help"):
            print(f"NAME:\n   {APP_NAME} - Generates GPU metrics in the prometheus format\n\n(rigup test-bed stand-in)")
            raise SystemExit(0)
        key, eq, value = arg.lstrip("-").partition("=")
        if not arg.startswith("-") or key not in names:
            sys.stderr.write(f"Incorrect Usage: flag provided but not defined: -{key}\n\n")
            raise SystemExit(1)
        name = names[key]
        if FLAGS[name][1]:
            if not eq:
                i += 1
                if i >= len(argv):
                    sys.stderr.write(f"Incorrect Usage: flag needs an argument: -{key}\n\n")
                    raise SystemExit(1)
                value = argv[i]
            opts[name] = value
        else:
            opts[name] = value.lower() not in ("false", "0") if eq else True
        i += 1
    return opts


def listen_address(address: str) -> tuple[int, str, int]:
    """(family, host, port) of a Go listen address: ":9400", "0.0.0.0:9400", "[::]:9400"."""
    host, _, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        return socket.AF_INET6, host[1:-1], int(port)
    return socket.AF_INET, host or "0.0.0.0", int(port)


# --- the GPUs, as NVML in the container shows them ------------------------------------------------


def driver_tools() -> tuple[Any, Any] | None:
    """The GPU stand-in's modules (nvidia_smi, common) from the driver directory the hook mounted, or None
    when the container has no driver (started without GPUs)."""
    root = os.environ.get("RIGUP_STANDIN_ROOT") or "/"
    smi = os.path.join(root, NVIDIA_SMI.lstrip("/"))
    if not os.path.exists(smi):
        return None
    libdir = os.path.dirname(os.path.realpath(smi))
    if not os.path.isfile(os.path.join(libdir, "nvidia_smi.py")):
        return None
    sys.path.insert(0, libdir)
    import common
    import nvidia_smi

    return nvidia_smi, common


class Gpus:
    def __init__(self, nvidia_smi: Any, common: Any):
        self.smi, self.common = nvidia_smi, common

    def read(self) -> tuple[list[Any], dict[str, Any]]:
        """The container's GPUs now (nvidia_smi.Gpu, in DCGM's order) and what every one shares."""
        smi, common = self.smi, self.common
        hw_gpus = list(common.hardware().get("gpus", []))
        visible = os.environ.get("NVIDIA_VISIBLE_DEVICES")
        if visible and visible not in ("all", "void", "none"):
            hw_gpus = common.gpus_named(hw_gpus, visible)
        # memory in use is the device's: every live GPU process counts, in whatever container it runs
        procs = []
        d = common.spath(PROCS_DIR)
        for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
            entry = common.read_json(os.path.join(d, name)) if name.endswith(".json") else None
            if isinstance(entry, dict) and common.registration_alive(entry):
                procs += [{"pid": entry.get("pid"), "name": entry.get("name", ""), "uuid": u,
                           "used_mib": int(entry.get("used_mib", 0)), "activity": entry.get("activity")}
                          for u in entry.get("gpus", [])]
        state = smi.load_state()
        gpus = [smi.Gpu(g, state, procs, minor) for minor, g in enumerate(hw_gpus)]
        driver = common.loaded_driver_version() or ""
        try:
            with open("/proc/uptime") as fh:
                uptime = float(fh.read().split()[0])
        except (OSError, ValueError, IndexError):
            uptime = 0.0
        return gpus, {"driver": driver, "nvml": ".".join(driver.split(".")[:2]), "uptime_s": uptime}


def profiling_supported(gpu: Any) -> bool:
    """DCGM's profiling module: datacenter GPUs from Volta on; GeForce cards only from Blackwell (FACTS.md)."""
    return not gpu.geforce or str(gpu.get("architecture", "")) == "Blackwell"


class Counter(NamedTuple):
    field: Field
    prom: str
    help: str


def read_counters(path: str, dcp: bool) -> list[Counter]:
    """The counters file as the exporter reads it: '#' lines are comments, fields trimmed, three per
    record; profiling fields skipped (with its warning, numbered by record) when there is no profiling."""
    with open(path, newline="") as fh:
        records = [row for row in csv.reader(line for line in fh if not line.startswith("#")) if row]
    out = []
    for i, record in enumerate(records):
        record = [r.strip(" ") for r in record]
        if len(record) != 3:
            raise ValueError(f"malformed CSV record; err: failed to parse line {i} (`[{' '.join(record)}]`), "
                             "expected 3 fields")
        name, prom, help_text = record
        if name.startswith("DCGM_FI_PROF_") and not dcp:
            log("WARN", f"Skipping line {i} ('{name}'): metric not enabled")
            continue
        if prom not in ("gauge", "counter", "histogram", "summary", "label"):
            raise ValueError(f"could not find Prometheus metric type '{prom}'")
        field = BY_NAME.get(name)
        if field is None:
            log("WARN", f"rigup stand-in: {name} is not simulated; left out")
            continue
        out.append(Counter(field, prom, help_text))
    return out


def _value(field: Field, value: Any) -> str:
    if field.kind == "d":
        return f"{float(value):f}"
    if field.kind == "i":
        return str(int(value))
    return str(value)


def render(counters: list[Counter], gpus: list[Any], shared: dict[str, Any], opts: dict[str, Any],
           hostname: str) -> str:
    uuid_label = "uuid" if opts.get("use-old-namespace") else "UUID"
    out: list[str] = []
    labels_of = []
    for gpu in gpus:
        labels = {}
        for c in counters:
            if c.prom == "label":
                value = c.field.read(gpu, shared)
                if value not in (None, ""):
                    labels[c.field.name] = str(value)
        labels_of.append(labels)
    for c in counters:
        if c.prom == "label":
            continue
        rows = []
        for gpu, labels in zip(gpus, labels_of):
            value = c.field.read(gpu, shared)
            if value is None:  # DCGM's blank: not supported by this GPU
                continue
            model = gpu.name
            if opts.get("replace-blanks-in-model-name"):
                model = "-".join(model.split())
            head = (f'gpu="{gpu.index}",{uuid_label}="{gpu.uuid}",pci_bus_id="{gpu.bus_id}",device="nvidia{gpu.index}",'
                    f'modelName="{model}"' + (f',Hostname="{hostname}"' if hostname else ""))
            extra = dict(sorted(labels.items()))
            if c.field.name == "DCGM_FI_DEV_XID_ERRORS":
                code = int(value)
                extra.update({"err_code": str(code), "err_msg": XID_TEXT.get(code, "Unknown Error")})
            rows.append(f"{c.field.name}{{{head}" + "".join(f',{k}="{v}"' for k, v in extra.items())
                        + f"}} {_value(c.field, value)}\n")
        if rows:
            out.append(f"# HELP {c.field.name} {c.help}\n# TYPE {c.field.name} {c.prom}\n")
            out += rows
    return "".join(out)


WEB_CONFIG_KEYS = {"tls_server_config": {"cert_file", "key_file"}, "basic_auth_users": None}  # None: any user name


def read_web_config(path: str) -> dict[str, dict[str, str]]:
    """exporter-toolkit's web config as block mappings: {section: {key: value}} (see the module's docstring)."""
    out: dict[str, dict[str, str]] = {}
    section = ""
    with open(path) as fh:
        for number, raw in enumerate(fh, 1):
            line = "" if raw.lstrip().startswith("#") else raw.split(" #")[0].rstrip()
            if not line.strip():
                continue
            key, _, value = line.strip().partition(":")
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            if not line.startswith(" "):
                if key not in WEB_CONFIG_KEYS or value:
                    raise ValueError(f"yaml: unmarshal errors: line {number}: field {key} not found in type web.Config")
                section = key
                out[section] = {}
                continue
            known = WEB_CONFIG_KEYS.get(section, set())
            if not section or (known is not None and key not in known):
                raise ValueError(f"yaml: unmarshal errors: line {number}: field {key} not found")
            out[section][key] = value
    return out


class Handler(http.server.BaseHTTPRequestHandler):
    server: Any
    protocol_version = "HTTP/1.1"  # as Go's net/http answers

    def authorized(self) -> bool:
        """exporter-toolkit's basic auth: the user's bcrypt hash checks the password (no users: everyone)."""
        users = self.server.users
        if not users:
            return True
        scheme, _, encoded = (self.headers.get("Authorization") or "").partition(" ")
        try:
            user, _, password = base64.b64decode(encoded, validate=True).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return False
        hashed = users.get(user)
        return scheme.lower() == "basic" and hashed is not None and hmac.compare_digest(crypt.crypt(password, hashed) or "", hashed)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass

    def reply(self, status: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        path = self.path.split("?")[0]
        if not self.authorized():
            self.send_response(401)
            self.send_header("Www-Authenticate", "Basic")
            body = b"Unauthorized\n"
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
        elif path == "/metrics":
            try:
                gpus, shared = self.server.gpus.read()
                body = render(self.server.counters, gpus, shared, self.server.opts, self.server.hostname).encode()
            except Exception as exc:  # noqa: BLE001 - what the exporter answers when a gather fails
                log("ERROR", "Failed to gather metrics from collectors", error=str(exc))
                self.reply(500, b"internal server error\n")
                return
            self.reply(200, body)
        elif path == "/health":
            self.reply(200, b"OK")
        elif path == "/":
            self.reply(200, b"<html>\n<head><title>GPU Exporter</title></head>\n<body>\n<h1>GPU Exporter</h1>\n"
                            b'<p><a href="./metrics">Metrics</a></p>\n<p><a href="./health">Health</a></p>\n'
                            b"</body>\n</html>", "text/html; charset=utf-8")
        else:
            self.reply(404, b"404 page not found\n")

    do_HEAD = do_GET


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    tls: ssl.SSLContext | None = None
    users: dict[str, str] = {}

    def finish_request(self, request: Any, client_address: Any) -> None:
        """With TLS: Go's answer to plain HTTP on a TLS port, else the handshake, in the connection's thread."""
        if self.tls is not None:
            try:
                first = request.recv(1, socket.MSG_PEEK)
                if first and first != b"\x16":  # not a TLS handshake record
                    request.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\nClient sent an HTTP request to an HTTPS server.\n")
                    return
                request = self.tls.wrap_socket(request, server_side=True)
            except (OSError, ssl.SSLError):
                return
        super().finish_request(request, client_address)


def main(argv: list[str]) -> int:
    opts = parse(argv)
    log("INFO", "Starting dcgm-exporter", Version=version())
    log("INFO", "Attempting to initialize DCGM.")
    tools = driver_tools()
    gpus_now: list[Any] = []
    if tools is not None:
        nvidia_smi, common = tools
        if common.loaded_driver_version() is not None:
            gpus_now = Gpus(nvidia_smi, common).read()[0]
    if not gpus_now:  # no NVML in the container (no --gpus), or no GPU behind it: DCGM cannot start
        log("ERROR", "error starting nv-hostengine: DCGM initialization error")
        return 1
    gpus = Gpus(*tools)
    log("INFO", "Initialized DCGM Fields module.")
    log("INFO", "NVML provider skipped (not running in Kubernetes mode)")
    log("INFO", "DCGM successfully initialized!")
    dcp = profiling_supported(gpus_now[0])  # the exporter asks DCGM about GPU 0's profiling groups
    if dcp:
        log("INFO", "Successfully queried DCGM profiling metric groups", reload_id=0, gpu_model=gpus_now[0].name)
    else:
        log("INFO", "Not collecting DCP metrics: This request is serviced by a module of DCGM that is not currently loaded")
    log("INFO", "Building registry for current GPU topology")
    log("INFO", f"Falling back to metric file '{opts['collectors']}'")
    try:
        counters = read_counters(opts["collectors"], dcp)
    except OSError as exc:
        error = f"open {opts['collectors']}: {exc.strerror.lower() if exc.strerror else exc}"
        log("ERROR", f"Could not read metrics file '{opts['collectors']}'; err: {error}")
        log("ERROR", error)
        return 1
    except ValueError as exc:
        log("ERROR", str(exc))
        return 1
    if opts.get("web-config-file"):
        try:
            web = read_web_config(opts["web-config-file"])
            tls = web.get("tls_server_config")
            if tls is not None:
                Server.tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
                Server.tls.minimum_version = ssl.TLSVersion.TLSv1_2  # exporter-toolkit's default min_version
                Server.tls.load_cert_chain(tls["cert_file"], tls["key_file"])
            Server.users = dict(web.get("basic_auth_users") or {})
        except (OSError, ValueError, KeyError, ssl.SSLError) as exc:
            log("ERROR", "Failed to Listen and Server HTTP server.", error=str(exc))
            return 1
        log("INFO", "TLS is enabled." if Server.tls is not None else "TLS is disabled.", http2=Server.tls is not None)
    family, host, port = listen_address(opts["address"])
    Server.address_family = family
    try:
        server = Server((host, port), Handler)
    except OSError as exc:
        log("ERROR", "Failed to Listen and Server HTTP server.", error=f"listen tcp {opts['address']}: bind: {exc.strerror}")
        return 1
    server.gpus, server.counters, server.opts = gpus, counters, opts
    server.hostname = "" if opts.get("no-hostname") else (os.environ.get("NODE_NAME") or socket.gethostname())
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
        signal.signal(sig, lambda *_: stop.set())
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()
    log("INFO", "Starting webserver")
    log("INFO", "HTTP server started - ready to serve metrics")
    stop.wait()
    log("INFO", "Shutting down gracefully...")
    server.shutdown()
    log("INFO", "Shutdown complete")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
