#!/usr/bin/python3
"""Stand-in for nvidia-smi (package nvidia-utils-<branch>).

Answers from the host's simulated hardware (/etc/rigup-testbed/hardware.json) once the stand-in
kernel module is loaded (/proc/driver/nvidia/version exists), and fails like the real tool before:
"couldn't communicate with the NVIDIA driver" (exit 9) when no module is loaded, "Driver/library version
mismatch" (exit 18) when the loaded module is another version than this userspace (an upgrade before
the reboot). Persistence mode and power limits set here live in /run, so they reset at reboot as on
real hardware.

The same /run state holds what a GPU reports that changes while it runs, for tests to set (a hot GPU,
an XID error): per GPU UUID in /run/nvidia-standin/gpu-state.json, `temperature_c`, `power_draw_w`,
`utilization_gpu`, `utilization_memory`, `clocks_event_reasons` (DCGM's bitmask) and `xid` (the last XID
error; 0: none) override hardware.json's value of the same name (see `set_gpu_state`). GPU containers
get /run/nvidia-standin from the toolkit's hook, so what reads it there (nvidia-smi, the DCGM exporter
stand-in) sees a change at once.

Unless a test sets them, utilisation, power, temperature and the clock event reasons follow the load of
the engines on the GPU: each records when it has requests running (responder.py, common.activity_record)
and `Gpu` turns that into a real RTX 3090's readings (the constants below; `thermal_c_per_w`, also a
gpu-state key, is how many degrees a watt adds: the rig's airflow).

Supported: plain table, -L, -q [-d POWER|MEMORY|PERFORMANCE|TEMPERATURE], --query-gpu=... and
--query-compute-apps=... with --format=csv[,noheader][,nounits], -i, -pm, -pl, topo -m, topo -p2p r,
--version. Anything else exits 2 with the real tool's "invalid combination" message.
"""

from __future__ import annotations

import os
import sys
import time

import common

TYPE_CHECKING = False  # typing's own flag; a call of this tool imports neither typing nor pathlib
if TYPE_CHECKING:
    from typing import Any, Callable

LOG = "/var/log/nvidia-standin/calls.log"
STATE_FILE = "/run/nvidia-standin/gpu-state.json"
PROCS_DIR = "/run/nvidia-standin/procs"

NO_DRIVER = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running.\n"
)
INVALID = "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n"


def userspace() -> dict[str, str]:
    """Version of this nvidia-smi/NVML (written next to the script by the package build)."""
    data = common.read_json(os.path.join(os.path.dirname(os.path.realpath(__file__)), "userspace.json"))
    if not isinstance(data, dict) or "version" not in data:
        common.fail("nvidia-smi stand-in: userspace.json missing next to the script", 255)
    return {k: str(v) for k, v in data.items()}


# --- state --------------------------------------------------------------------------------------


def load_state() -> dict[str, Any]:
    state = common.read_json(common.spath(STATE_FILE), {})
    # A state file from another boot is stale (only possible in test mode: /run is a tmpfs otherwise). In
    # a container the hook mounted the host's live /run/nvidia-standin, and /proc's boot_id is the kernel's,
    # not the one systemd-nspawn gives a test-bed host: there is nothing to compare.
    comparable = common.test_mode() or not common.in_container()
    if not isinstance(state, dict) or "gpus" not in state or (comparable and state.get("boot_id") != common.boot_id()):
        return {"boot_id": common.boot_id(), "gpus": {}}
    return state


def save_state(state: dict[str, Any]) -> None:
    common.write_json_atomic(common.spath(STATE_FILE), state)


def set_gpu_state(uuid: str, **values: Any) -> None:
    """Set what GPU `uuid` reports from now on (temperature_c=92, xid=79, ...; None removes a value): how
    a test makes a GPU hot or faulty. Lasts until the next boot, as the driver's own state does."""
    with common.locked(common.spath(STATE_FILE) + ".lock"):
        state = load_state()
        gpu = state["gpus"].setdefault(uuid, {})
        for key, value in values.items():
            if value is None:
                gpu.pop(key, None)
            else:
                gpu[key] = value
        save_state(state)


def processes(gpus: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Compute processes registered by running stand-in containers (the responder), dead ones dropped."""
    found = []
    uuids = {g["uuid"] for g in gpus}
    d = common.spath(PROCS_DIR)
    names = sorted(n for n in os.listdir(d) if n.endswith(".json") and not n.startswith(".")) if os.path.isdir(d) else []
    for name in names:
        entry = common.read_json(os.path.join(d, name))
        if not isinstance(entry, dict):
            continue
        # a process in a container registered its own pid and namespace; report it as seen from here
        pid = common.host_pid(int(entry.get("pid", 0) or 0), str(entry.get("pidns") or ""), entry.get("starttime"))
        if pid is None:
            continue
        for uuid in entry.get("gpus", []):
            if uuid in uuids:
                found.append({"pid": pid, "name": entry.get("name", "python3"), "uuid": uuid,
                              "used_mib": int(entry.get("used_mib", 0)), "activity": entry.get("activity")})
    return found


# --- a GPU under load (FACTS.md section 12, "under load") ----------------------------------------
# With no engine on it the card idles at IDLE_*; an engine loaded and idle holds it at READY_*. Running
# requests (the engines' activity records, common.activity_at) raise utilisation and power at once, up
# to the power limit under full load, and the temperature over THERMAL_TAU_S toward where that power
# takes it: READY_TEMP_C plus thermal_c_per_w per watt above READY_POWER_W (the rig's airflow; a
# hardware.json or gpu-state key). GeForce GPU Boost holds the card at its target temperature by
# lowering clocks and power (clock event reason SW thermal slowdown); below it, full load runs at the
# power limit (reason SW power cap).
IDLE_TEMP_C, READY_TEMP_C = 35, 45
IDLE_POWER_W, READY_POWER_W = 20.0, 110.0
THERMAL_C_PER_W = (READY_TEMP_C - IDLE_TEMP_C) / (READY_POWER_W - IDLE_POWER_W)
TARGET_TEMP_C = 83  # a real RTX 3090's "GPU Target Temperature" (gpu_target_temperature)
REASON_IDLE, REASON_SW_POWER_CAP, REASON_SW_THERMAL = 0x1, 0x4, 0x20  # DCGM_CLOCKS_EVENT_REASON_*


class Gpu:
    """One GPU as this nvidia-smi sees it: hardware.json values plus the /run state."""

    def __init__(self, hw: dict[str, Any], state: dict[str, Any], procs: list[dict[str, Any]], minor: int):
        self.hw = hw
        self.st = state["gpus"].setdefault(hw["uuid"], {})
        self.minor = minor
        self.procs = [p for p in procs if p["uuid"] == hw["uuid"]]
        # how busy its busiest engine has been: (fast: utilisation and power, slow: temperature)
        now = time.time()
        levels = [common.activity_at(p.get("activity"), now) for p in self.procs]
        self.fast = max((f for f, _ in levels), default=0.0)
        self.slow = max((s for _, s in levels), default=0.0)

    def get(self, key: str, default: Any) -> Any:
        value = self.hw.get(key)
        return default if value is None else value

    def live(self, key: str, default: Any) -> Any:
        """A value that changes while the GPU runs: the /run state's (set by a test), else hardware.json's."""
        value = self.st.get(key)
        return self.get(key, default) if value is None else value

    @property
    def index(self) -> int:
        return self.minor

    @property
    def name(self) -> str:
        return str(self.hw["name"])

    @property
    def uuid(self) -> str:
        return str(self.hw["uuid"])

    @property
    def bus_id(self) -> str:
        return str(self.hw["pci_bus_id"])

    @property
    def geforce(self) -> bool:
        return "GeForce" in self.name or "TITAN" in self.name

    @property
    def persistence(self) -> bool:
        return bool(self.st.get("persistence", self.get("persistence_mode", False)))

    @property
    def power_limit(self) -> float:
        return float(self.st.get("power_limit_w", self.hw["power_limit_w"]))

    @property
    def total(self) -> int:
        return int(self.hw["memory_total_mib"])

    @property
    def reserved(self) -> int:
        return int(self.get("memory_reserved_mib", 0))

    @property
    def used(self) -> int:
        return int(self.get("memory_used_mib", 0)) + sum(p["used_mib"] for p in self.procs)

    @property
    def free(self) -> int:
        return max(0, self.total - self.reserved - self.used)

    @property
    def busy(self) -> bool:
        return bool(self.procs)

    @property
    def thermal_c_per_w(self) -> float:
        return float(self.live("thermal_c_per_w", THERMAL_C_PER_W))

    def _load_power(self, level: float) -> float:
        """The power an engine at this busy level draws: READY_POWER_W idle, the power limit under full load."""
        ready = min(READY_POWER_W, self.power_limit)
        return ready + (self.power_limit - ready) * level

    def _heat(self) -> tuple[float, bool]:
        """(temperature, held at the target by GPU Boost) from the slow busy level and the airflow."""
        if not self.busy:
            return float(IDLE_TEMP_C), False
        rise = READY_TEMP_C + self.thermal_c_per_w * (self._load_power(self.slow) - READY_POWER_W)
        return (float(TARGET_TEMP_C), True) if rise >= TARGET_TEMP_C else (rise, False)

    @property
    def thermally_held(self) -> bool:
        return self._heat()[1]

    @property
    def temperature(self) -> int:
        return int(self.live("temperature_c", round(self._heat()[0])))

    @property
    def power_draw(self) -> float:
        if not self.busy:
            return float(self.live("power_draw_w", IDLE_POWER_W))
        power = self._load_power(self.fast)
        if self.thermally_held:  # the power that keeps the card at its target temperature
            power = min(power, READY_POWER_W + (TARGET_TEMP_C - READY_TEMP_C) / self.thermal_c_per_w)
        return float(self.live("power_draw_w", round(power, 2)))

    @property
    def utilization(self) -> int:
        return int(self.live("utilization_gpu", round(100 * self.fast)))

    @property
    def utilization_memory(self) -> int:
        # decoding reads the weights and the KV cache every step: the memory controller is busy whenever
        # the engine is (the share of it is not from a capture)
        return int(self.live("utilization_memory", round(100 * self.fast)))

    @property
    def xid(self) -> int:
        """The last XID error the driver reported for this GPU (0: none since boot)."""
        return int(self.live("xid", 0))

    @property
    def clocks_event_reasons(self) -> int:
        """Why the clocks are held down, as DCGM's bitmask (DCGM_CLOCKS_EVENT_REASON_*): idle (0x1) while
        no engine on it has work; under load, SW thermal slowdown while GPU Boost holds the target
        temperature, else SW power cap while it draws its power limit."""
        if self.fast < 0.5:
            reasons = REASON_IDLE
        elif self.thermally_held:
            reasons = REASON_SW_THERMAL
        elif self._load_power(self.fast) >= 0.97 * self.power_limit:
            reasons = REASON_SW_POWER_CAP
        else:
            reasons = 0
        return int(self.live("clocks_event_reasons", reasons))

    @property
    def sm_clock(self) -> int:
        idle, busy = (345, 1980) if "H200" in self.name else (210, 1695)  # FACTS.md section 12
        return int(self.live("clocks_sm_mhz", busy if self.busy else idle))

    @property
    def mem_clock(self) -> int:
        idle, busy = (3201, 3201) if "H200" in self.name else (405, 9751)
        return int(self.live("clocks_mem_mhz", busy if self.busy else idle))

    @property
    def memory_temperature(self) -> int | None:
        """HBM reports its temperature; a GeForce card's GDDR does not (N/A)."""
        if self.geforce:
            return None
        return int(self.live("memory_temperature_c", self.temperature + 5))

    @property
    def pstate(self) -> str:
        return str(self.get("pstate", "P2" if self.busy else "P8"))

    @property
    def fan(self) -> str | None:
        value = self.hw.get("fan_percent", 30 if self.geforce else None)
        return None if value is None else str(value)

    @property
    def ecc(self) -> str | None:
        value = self.hw.get("ecc_errors", None if self.geforce else 0)
        return None if value is None else str(value)

    @property
    def mig(self) -> str | None:
        value = self.hw.get("mig_mode", None if self.geforce else "Disabled")
        return None if value is None else str(value)

    @property
    def brand(self) -> str:
        return str(self.get("brand", "GeForce" if self.geforce else "NVIDIA"))


# --- argument parsing ---------------------------------------------------------------------------


def parse_args(argv: list[str]) -> dict[str, Any]:
    """nvidia-smi's flags: `-i 0`, `--id=0`, `-pm 1`, `--query-gpu=a,b`, `--format=csv` ..."""
    opts: dict[str, Any] = {"positional": []}
    takes_value = {
        "-i": "id", "--id": "id", "-pm": "pm", "--persistence-mode": "pm", "-pl": "pl",
        "--power-limit": "pl", "--query-gpu": "query_gpu", "--query-compute-apps": "query_apps",
        "--format": "format", "-d": "display", "--display": "display", "-f": "filename",
        "--filename": "filename",
    }
    flags = {"-L": "list", "--list-gpus": "list", "-q": "query", "--query": "query", "-m": "matrix",
             "--matrix": "matrix", "-h": "help", "--help": "help", "--version": "version",
             "-p2p": "p2p", "--p2p-status": "p2p"}
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in takes_value:
            if not eq:
                i += 1
                if i >= len(argv):
                    raise ValueError(arg)
                value = argv[i]
            opts[takes_value[name]] = value
        elif arg in flags:
            opts[flags[arg]] = True
        elif arg.startswith("-"):
            raise ValueError(arg)
        else:
            opts["positional"].append(arg)
        i += 1
    return opts


def select(gpus: list[Gpu], spec: str | None) -> list[Gpu]:
    if spec is None:
        return gpus
    chosen = []
    for token in spec.split(","):
        token = token.strip()
        match = [
            g for g in gpus
            if token == str(g.index) or token == g.uuid or token.lower() == g.bus_id.lower()
            or (len(token) > 4 and g.bus_id.lower().endswith(token.lower()))
        ]
        if not match:
            return []
        chosen.extend(m for m in match if m not in chosen)
    return chosen


# --- output -------------------------------------------------------------------------------------

WIDE = "+" + "-" * 89 + "+"
SPLIT = "+-----------------------------------------+------------------------+----------------------+"


def table(gpus: list[Gpu], smi_version: str, driver: str, cuda: str) -> str:
    def cut(name: str, width: int) -> str:
        return name if len(name) <= width else name[: width - 3] + "..."

    lines = [
        time.strftime("%a %b %d %H:%M:%S %Y") + "       ",
        WIDE,
        f"| NVIDIA-SMI {smi_version:<23}Driver Version: {driver:<15}CUDA Version: {cuda:<9}|",
        SPLIT,
        "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |",
        "| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |",
        "|                                         |                        |               MIG M. |",
        "|=========================================+========================+======================|",
    ]
    for g in gpus:
        pm = "On" if g.persistence else "Off"
        fan = "N/A" if g.fan is None else f"{g.fan}%"
        lines.append(
            f"| {g.index:>3}  {cut(g.name, 30):<31}{pm:<3} | {g.bus_id:>18} {g.get('display_active', 'Off'):<3} |"
            f" {('N/A' if g.ecc is None else g.ecc):>20} |"
        )
        util = f"{g.utilization}%"
        lines.append(
            f"| {fan:>3}  {g.temperature:>3}C    {g.pstate:<2}{round(g.power_draw):>15}W / {round(g.power_limit):>4}W |"
            f" {g.used:>7}MiB / {g.total:>6}MiB | {util:>7}      Default |"
        )
        lines.append(f"|                                         |                        | {('N/A' if g.mig is None else g.mig):>20} |")
        lines.append(SPLIT)
    lines += [
        "",
        WIDE,
        "| Processes:                                                                              |",
        "|  GPU   GI   CI              PID   Type   Process name                        GPU Memory |",
        "|        ID   ID                                                               Usage      |",
        "|=========================================================================================|",
    ]
    procs = [(g, p) for g in gpus for p in g.procs]
    if not procs:
        lines.append("|  No running processes found                                                             |")
    head = lines[-3]
    for g, p in procs:
        row = [" "] * len(head)
        row[0] = row[-1] = "|"

        def put(text: str, end: int) -> None:
            row[end - len(text):end] = list(text)

        put(str(g.index), head.index("GPU") + 3)
        put("N/A", head.index(" GI ") + 3)
        put("N/A", head.index(" CI ") + 3)
        put(str(p["pid"]), head.index("PID") + 3)
        put("C", head.index("Type") + 3)
        name = cut(p["name"], 34)
        start = head.index("Process name")
        row[start:start + len(name)] = list(name)
        put(f"{p['used_mib']}MiB", len(head) - 2)
        lines.append("".join(row))
    lines.append(WIDE)
    return "\n".join(lines) + "\n"


def q_line(key: str, value: Any, depth: int) -> str:
    return f"{' ' * (4 * depth) + key:<55}: {value}"


def query_report(gpus: list[Gpu], driver: str, cuda: str, display: set[str] | None) -> str:
    out = ["", "==============NVSMI LOG==============", "",
           q_line("Timestamp", time.strftime("%a %b %d %H:%M:%S %Y"), 0),
           q_line("Driver Version", driver, 0), q_line("CUDA Version", cuda, 0), "",
           q_line("Attached GPUs", len(gpus), 0)]

    def want(section: str) -> bool:
        return display is None or section in display

    for g in gpus:
        out.append(f"GPU {g.bus_id}")
        if display is None:
            out += [
                q_line("Product Name", g.name, 1),
                q_line("Product Brand", g.brand, 1),
                q_line("Product Architecture", g.get("architecture", "Ampere"), 1),
                q_line("Persistence Mode", "Enabled" if g.persistence else "Disabled", 1),
                q_line("GPU UUID", g.uuid, 1),
                q_line("Minor Number", g.minor, 1),
                q_line("PCI", "", 1).rstrip(": ").rstrip(),
                q_line("Bus Id", g.bus_id, 2),
                q_line("Fan Speed", "N/A" if g.fan is None else f"{g.fan} %", 1),
            ]
        if want("PERFORMANCE"):
            out.append(q_line("Performance State", g.pstate, 1))
        if want("MEMORY"):
            out += [
                "    FB Memory Usage",
                q_line("Total", f"{g.total} MiB", 2),
                q_line("Reserved", f"{g.reserved} MiB", 2),
                q_line("Used", f"{g.used} MiB", 2),
                q_line("Free", f"{g.free} MiB", 2),
            ]
        if display is None:
            out += [q_line("Compute Mode", "Default", 1), "    Utilization",
                    q_line("GPU", f"{g.utilization} %", 2)]
        if want("TEMPERATURE"):
            out += ["    Temperature", q_line("GPU Current Temp", f"{g.temperature} C", 2)]
        if want("POWER"):
            out += [
                "    GPU Power Readings",
                q_line("Average Power Draw", f"{g.power_draw:.2f} W", 2),
                q_line("Instantaneous Power Draw", f"{g.power_draw:.2f} W", 2),
                q_line("Current Power Limit", f"{g.power_limit:.2f} W", 2),
                q_line("Requested Power Limit", f"{g.power_limit:.2f} W", 2),
                q_line("Default Power Limit", f"{float(g.hw['power_default_w']):.2f} W", 2),
                q_line("Min Power Limit", f"{float(g.hw['power_min_w']):.2f} W", 2),
                q_line("Max Power Limit", f"{float(g.hw['power_max_w']):.2f} W", 2),
            ]
        if display is None:
            if g.procs:
                out.append("    Processes")
                for p in g.procs:
                    out += [q_line("GPU instance ID", "N/A", 2), q_line("Compute instance ID", "N/A", 2),
                            q_line("Process ID", p["pid"], 2), q_line("Type", "C", 2),
                            q_line("Name", p["name"], 2), q_line("Used GPU Memory", f"{p['used_mib']} MiB", 2)]
            else:
                out.append(q_line("Processes", "None", 1))
        out.append("")
    return "\n".join(out) + "\n"


# Query field -> (header, value getter, unit). Unit None: printed bare; "[N/A]" for unsupported.
def _watts(v: float) -> str:
    return f"{v:.2f}"


FIELDS: dict[str, tuple[str, Callable[[Gpu, dict[str, Any]], Any], str | None]] = {
    "timestamp": ("timestamp", lambda g, c: time.strftime("%Y/%m/%d %H:%M:%S.000"), None),
    "driver_version": ("driver_version", lambda g, c: c["driver"], None),
    "count": ("count", lambda g, c: c["count"], None),
    "index": ("index", lambda g, c: g.index, None),
    "name": ("name", lambda g, c: g.name, None),
    "gpu_name": ("name", lambda g, c: g.name, None),
    "uuid": ("uuid", lambda g, c: g.uuid, None),
    "gpu_uuid": ("uuid", lambda g, c: g.uuid, None),
    "serial": ("serial", lambda g, c: None if g.geforce else g.get("serial", "1650000000000"), None),
    "gpu_serial": ("serial", lambda g, c: None if g.geforce else g.get("serial", "1650000000000"), None),
    "pci.bus_id": ("pci.bus_id", lambda g, c: g.bus_id, None),
    "gpu_bus_id": ("pci.bus_id", lambda g, c: g.bus_id, None),
    "vbios_version": ("vbios_version", lambda g, c: g.get("vbios_version", "94.02.42.00.A9"), None),
    "compute_cap": ("compute_cap", lambda g, c: g.hw["compute_cap"], None),
    "persistence_mode": ("persistence_mode", lambda g, c: "Enabled" if g.persistence else "Disabled", None),
    "pstate": ("pstate", lambda g, c: g.pstate, None),
    "fan.speed": ("fan.speed [%]", lambda g, c: g.fan, "%"),
    "temperature.gpu": ("temperature.gpu", lambda g, c: g.temperature, None),
    "utilization.gpu": ("utilization.gpu [%]", lambda g, c: g.utilization, "%"),
    "utilization.memory": ("utilization.memory [%]", lambda g, c: g.utilization_memory, "%"),
    "memory.total": ("memory.total [MiB]", lambda g, c: g.total, "MiB"),
    "memory.reserved": ("memory.reserved [MiB]", lambda g, c: g.reserved, "MiB"),
    "memory.used": ("memory.used [MiB]", lambda g, c: g.used, "MiB"),
    "memory.free": ("memory.free [MiB]", lambda g, c: g.free, "MiB"),
    "power.draw": ("power.draw [W]", lambda g, c: _watts(g.power_draw), "W"),
    "power.draw.average": ("power.draw.average [W]", lambda g, c: _watts(g.power_draw), "W"),
    "power.draw.instant": ("power.draw.instant [W]", lambda g, c: _watts(g.power_draw), "W"),
    "power.limit": ("power.limit [W]", lambda g, c: _watts(g.power_limit), "W"),
    "enforced.power.limit": ("enforced.power.limit [W]", lambda g, c: _watts(g.power_limit), "W"),
    "power.default_limit": ("power.default_limit [W]", lambda g, c: _watts(float(g.hw["power_default_w"])), "W"),
    "power.min_limit": ("power.min_limit [W]", lambda g, c: _watts(float(g.hw["power_min_w"])), "W"),
    "power.max_limit": ("power.max_limit [W]", lambda g, c: _watts(float(g.hw["power_max_w"])), "W"),
    "compute_mode": ("compute_mode", lambda g, c: "Default", None),
    "mig.mode.current": ("mig.mode.current", lambda g, c: g.mig, None),
    "display_active": ("display_active", lambda g, c: "Disabled", None),
    "pci.device_id": ("pci.device_id", lambda g, c: g.get("pci_device_id", "0x220410DE"), None),
}

APP_FIELDS: dict[str, tuple[str, str, str | None]] = {
    "pid": ("pid", "pid", None),
    "process_name": ("process_name", "name", None),
    "name": ("process_name", "name", None),
    "used_memory": ("used_gpu_memory [MiB]", "used_mib", "MiB"),
    "used_gpu_memory": ("used_gpu_memory [MiB]", "used_mib", "MiB"),
    "gpu_uuid": ("gpu_uuid", "uuid", None),
    "gpu_bus_id": ("gpu_bus_id", "bus_id", None),
    "gpu_name": ("gpu_name", "gpu_name", None),
    "timestamp": ("timestamp", "timestamp", None),
}


def parse_format(fmt: str | None) -> tuple[bool, bool]:
    parts = [p.strip() for p in (fmt or "").split(",") if p.strip()]
    if not parts or parts[0] != "csv" or any(p not in ("csv", "noheader", "nounits") for p in parts):
        raise ValueError(fmt)
    return "noheader" not in parts, "nounits" not in parts


def csv_cell(value: Any, unit: str | None, units: bool) -> str:
    if value is None:
        return "[N/A]"
    return f"{value} {unit}" if unit and units else str(value)


def query_gpu(gpus: list[Gpu], fields_spec: str, fmt: str | None, ctx: dict[str, Any]) -> str:
    header, units = parse_format(fmt)
    fields = [f.strip() for f in fields_spec.split(",") if f.strip()]
    for f in fields:
        if f not in FIELDS:
            common.fail(f'Field "{f}" is not a valid field to query.\n', 2)
    rows = []
    if header:
        rows.append(", ".join(FIELDS[f][0] for f in fields))
    for g in gpus:
        rows.append(", ".join(csv_cell(FIELDS[f][1](g, ctx), FIELDS[f][2], units) for f in fields))
    return "\n".join(rows) + "\n"


def query_apps(gpus: list[Gpu], fields_spec: str, fmt: str | None) -> str:
    header, units = parse_format(fmt)
    fields = [f.strip() for f in fields_spec.split(",") if f.strip()]
    for f in fields:
        if f not in APP_FIELDS:
            common.fail(f'Field "{f}" is not a valid field to query.\n', 2)
    rows = [", ".join(APP_FIELDS[f][0] for f in fields)] if header else []
    for g in gpus:
        for p in g.procs:
            values = dict(p, bus_id=g.bus_id, gpu_name=g.name, timestamp=time.strftime("%Y/%m/%d %H:%M:%S.000"))
            rows.append(", ".join(csv_cell(values[APP_FIELDS[f][1]], APP_FIELDS[f][2], units) for f in fields))
    return "\n".join(rows) + ("\n" if rows else "")


LEGEND = """
Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
"""

P2P_LEGEND = """
Legend:

  X    = Self
  OK   = Status Ok
  CNS  = Chipset not supported
  GNS  = GPU not supported
  TNS  = Topology not supported
  NS   = Not supported
  U    = Unknown
"""


def link(hw: dict[str, Any], a: int, b: int) -> str:
    topo = hw.get("topology") or "PHB"
    if isinstance(topo, list):  # full matrix form
        return str(topo[a][b])
    return str(topo)


def topo_matrix(hw: dict[str, Any], gpus: list[Gpu]) -> str:
    cpus = hw.get("cpu_affinity") or f"0-{(os.cpu_count() or 1) - 1}"
    numa = hw.get("numa_affinity", 0)
    head = "".join(f"GPU{g.index}\t" for g in gpus)
    lines = [f"\t\x1b[4m{head}CPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m"]
    for g in gpus:
        cells = "".join((" X " if h.index == g.index else link(hw, g.index, h.index)) + "\t" for h in gpus)
        lines.append(f"GPU{g.index}\t{cells}{cpus}\t{numa}\t\tN/A")
    return "\n".join(lines) + "\n" + LEGEND


def topo_p2p(hw: dict[str, Any], gpus: list[Gpu]) -> str:
    default = "OK" if any(link(hw, 0, 1).startswith("NV") for _ in [0] if len(gpus) > 1) else "NS"
    status = str(hw.get("p2p") or default)
    lines = [" \t" + "".join(f"GPU{g.index}\t" for g in gpus)]
    for g in gpus:
        lines.append(f" GPU{g.index}\t" + "".join(("X" if h.index == g.index else status) + "\t" for h in gpus))
    return "\n".join(lines) + "\n" + P2P_LEGEND


# --- commands -----------------------------------------------------------------------------------


def set_persistence(gpus: list[Gpu], value: str, state: dict[str, Any]) -> int:
    if value not in ("0", "1", "ENABLED", "DISABLED", "enabled", "disabled"):
        common.fail(INVALID, 2)
    enable = value in ("1", "ENABLED", "enabled")
    if not common.is_root():
        print(f"Unable to set persistence mode for GPU {gpus[0].bus_id}: Insufficient Permissions")
        print("Terminating early due to previous errors.")
        return 4
    word = "Enabled" if enable else "Disabled"
    for g in gpus:
        if g.persistence == enable:
            print(f"Persistence mode is already {word} for GPU {g.bus_id}.")
        else:
            g.st["persistence"] = enable
            print(f"{word} persistence mode for GPU {g.bus_id}.")
    save_state(state)
    print("All done.")
    return 0


def set_power_limit(gpus: list[Gpu], value: str, state: dict[str, Any]) -> int:
    try:
        watts = float(value)
    except ValueError:
        common.fail(INVALID, 2)
    if not common.is_root():
        print(f"Changing power management limit is not supported in current scope for GPU: {gpus[0].bus_id}.")
        print("Insufficient Permissions")
        print("Terminating early due to previous errors.")
        return 4
    for g in gpus:
        lo, hi = float(g.hw["power_min_w"]), float(g.hw["power_max_w"])
        if not lo <= watts <= hi:
            print(
                f"Provided power limit {watts:.2f} W is not a valid power limit which should be between "
                f"{lo:.2f} W and {hi:.2f} W for GPU {g.bus_id}"
            )
            print("Terminating early due to previous errors.")
            return 2
    for g in gpus:
        if not g.persistence:
            print(
                f"Warning: persistence mode is disabled on device {g.bus_id}. See the Known Issues section of "
                "the nvidia-smi(1) man page for more information. Run with [--help | -h] switch to get more "
                "information on how to enable persistence mode."
            )
        old = g.power_limit
        g.st["power_limit_w"] = watts
        print(f"Power limit for GPU {g.bus_id} was set to {watts:.2f} W from {old:.2f} W.")
    save_state(state)
    print("All done.")
    return 0


def main(argv: list[str]) -> int:
    common.log_call(LOG, "nvidia-smi", argv)
    try:
        opts = parse_args(argv)
    except ValueError:
        sys.stdout.write(INVALID)
        return 2
    if opts.get("help"):
        print("NVIDIA System Management Interface -- v" + userspace()["version"])
        print("(rigup test-bed stand-in; see rigup_testbed/standins/nvidia_smi.py)")
        return 0
    us = userspace()
    hw = common.hardware()
    loaded = common.loaded_driver_version()
    if loaded is None:
        sys.stdout.write(NO_DRIVER)
        return 9
    if loaded != us["version"]:
        nvml = ".".join(us["version"].split(".")[:2])
        sys.stdout.write(f"Failed to initialize NVML: Driver/library version mismatch\nNVML library version: {nvml}\n")
        return 18
    cuda = common.driver_cuda(us["version"], us.get("cuda"))
    if opts.get("version"):
        print(f"NVIDIA-SMI version  : {us['version']}")
        print(f"NVML version        : {'.'.join(us['version'].split('.')[:2])}")
        print(f"DRIVER version      : {loaded}")
        print(f"CUDA Version        : {cuda}")
        return 0

    state = load_state()
    hw_gpus = list(hw.get("gpus", []))
    # Inside a stand-in container only the GPUs handed to it are visible, renumbered from 0.
    visible = os.environ.get("NVIDIA_VISIBLE_DEVICES")
    if visible and visible not in ("all", "void", "none"):
        hw_gpus = common.gpus_named(hw_gpus, visible)
    procs = processes(hw_gpus)
    gpus = [Gpu(g, state, procs, minor) for minor, g in enumerate(hw_gpus)]
    if not gpus:
        print("No devices were found")
        return 6
    chosen = select(gpus, opts.get("id"))
    if not chosen:
        print("No devices were found")
        return 6
    ctx = {"driver": loaded, "count": len(gpus)}
    pos = opts["positional"]

    if pos[:1] == ["topo"]:
        if opts.get("matrix"):
            sys.stdout.write(topo_matrix(hw, gpus))
            return 0
        if opts.get("p2p") and pos[1:2] == ["r"]:
            sys.stdout.write(topo_p2p(hw, gpus))
            return 0
        sys.stdout.write(INVALID)
        return 2
    if pos:
        sys.stdout.write(INVALID)
        return 2
    if "pm" in opts:
        return set_persistence(chosen, opts["pm"], state)
    if "pl" in opts:
        return set_power_limit(chosen, opts["pl"], state)
    try:
        if "query_gpu" in opts:
            sys.stdout.write(query_gpu(chosen, opts["query_gpu"], opts.get("format"), ctx))
            return 0
        if "query_apps" in opts:
            sys.stdout.write(query_apps(chosen, opts["query_apps"], opts.get("format")))
            return 0
    except ValueError:
        sys.stdout.write(INVALID)
        return 2
    if opts.get("list"):
        for g in chosen:
            print(f"GPU {g.index}: {g.name} (UUID: {g.uuid})")
        return 0
    if opts.get("query"):
        display = None
        if opts.get("display"):
            display = {d.strip().upper() for d in opts["display"].split(",")}
            if not display <= {"POWER", "MEMORY", "PERFORMANCE", "TEMPERATURE"}:
                sys.stdout.write(INVALID)
                return 2
        sys.stdout.write(query_report(chosen, loaded, cuda, display))
        return 0
    sys.stdout.write(table(chosen, us["version"], loaded, cuda))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
