"""The gateway venv's pip command (rigup/operations/gateway.py): by default pip's own configured index
(pip.conf, PIP_INDEX_URL on the gateway host), an explicit gateway_pip_index_url when one is set. Run
through pyinfra's API on a @fake host whose venv is not built yet."""

from __future__ import annotations

import shlex
import stat
import subprocess
from pathlib import Path
from typing import Any

from pyinfra.api import Config, Inventory, State
from pyinfra.api.connect import connect_all, disconnect_all
from pyinfra.api.operation import add_op
from pyinfra.api.operations import run_ops

from rigup.desired.gateway import gateway_plan
from rigup.desired.knobs import load_defaults
from rigup.operations.gateway import PIP_LOG, gateway_venv

VENV = "/opt/rigup/gateway/venv-abc"
REQUIREMENTS = "/opt/rigup/gateway/requirements.txt"
MARKER = ".rigup-installed"  # VenvComplete's fact reads it: no answer, so the venv is (re)built


def build_command(index_url: str | None, venv: str = VENV, verbose: bool = False) -> str:
    """The shell command the operation runs to build the venv (its one change), as `sh -c` gets it."""
    inventory = Inventory((["@fake/gw"], {"fake_delay": 0, "fake_delay_jitter": 0, "fake_responses": {}}))
    state = State(inventory=inventory, config=Config())
    state.print_noop_info = verbose  # what pyinfra -v sets
    connect_all(state)
    host = inventory.get_host("@fake/gw")
    add_op(state, gateway_venv, name="gateway venv", venv=venv, requirements=REQUIREMENTS,
           requirements_sha256="abc", index_url=index_url)
    before = len(host.connector.executed_commands)
    run_ops(state)
    disconnect_all(state)
    builds = [c for c in host.connector.executed_commands[before:] if "bin/pip" in c and "install" in c]
    assert len(builds) == 1, host.connector.executed_commands[before:]
    # the command runs as `sh -c '...'` (through sudo): unwrap it
    outer = shlex.split(builds[0])
    return outer[-1] if outer[-2:-1] == ["-c"] else builds[0]


def pip_words(index_url: str | None) -> list[str]:
    """The words of the pip install the operation runs for `index_url`."""
    inner = shlex.split(build_command(index_url))
    start = inner.index(f"{VENV}/bin/pip")
    return inner[start:min(inner.index(end, start) for end in (">", "&&") if end in inner[start:])]


def test_by_default_pip_uses_its_own_configured_index() -> None:
    words = pip_words(None)
    assert words[:2] == [f"{VENV}/bin/pip", "install"]
    assert "--require-hashes" in words and "--no-deps" in words and words[-2:] == ["-r", REQUIREMENTS]
    assert not any(w.startswith(("--index-url", "-i", "--trusted-host", "--extra-index-url")) for w in words)


def test_an_explicit_index_is_passed_as_pip_takes_it() -> None:
    words = pip_words("https://mirror.lan/pypi/simple")
    assert words[words.index("--index-url") + 1] == "https://mirror.lan/pypi/simple"
    assert "--trusted-host" not in words  # https needs no trust


def test_a_plain_http_index_is_trusted_by_host() -> None:
    words = pip_words("http://10.213.0.1:8083/simple")  # what the test bed's hub serves
    assert words[words.index("--index-url") + 1] == "http://10.213.0.1:8083/simple"
    assert words[words.index("--trusted-host") + 1] == "10.213.0.1"


def test_the_plan_carries_no_index_unless_the_knob_sets_one(tmp_path: Any) -> None:
    key = tmp_path / "gateway.key"
    key.write_text("sk-gateway-0123456789\n")
    key.chmod(0o600)
    data = {**load_defaults(), "serves_variant": False, "gateway_api_key_file": str(key)}
    assert load_defaults()["gateway_pip_index_url"] is None
    plan = gateway_plan("gw", data, ["gateway"], [("gw", data)])
    assert plan is not None and plan.pip_index_url is None
    data["gateway_pip_index_url"] = "https://mirror.lan/simple"
    plan = gateway_plan("gw", data, ["gateway"], [("gw", data)])
    assert plan is not None and plan.pip_index_url == "https://mirror.lan/simple"


# --- what the build prints: run the real command with a stand-in python3 whose venv's pip prints as pip does

FAKE_PYTHON3 = """#!/bin/sh
# python3 -m venv DIR: a venv whose pip prints what pip prints for two pins (and a config warning each)
mkdir -p "$3/bin"
cat > "$3/bin/pip" <<'PIP'
#!/bin/sh
umask > "$(dirname "$0")/../umask-pip-ran-with"
for p in six mdurl; do
  echo "WARNING: Location 'file:///opt/pypi-more/simple/$p/' is ignored: it is neither a file nor a directory."
  echo "Collecting $p==1.0 (from -r /opt/rigup/gateway/requirements.txt (line 1))"
  echo "  Downloading $p-1.0-py3-none-any.whl (11 kB)"
done
echo "Installing collected packages: six, mdurl"
[ -z "$PIP_FAILS" ] || { echo "ERROR: THESE PACKAGES DO NOT MATCH THE HASHES"; exit 1; }
echo "Successfully installed mdurl-1.0 six-1.0"
PIP
chmod +x "$3/bin/pip"
"""


CALLER_UMASK = 0o022


def run_build(tmp_path: Any, verbose: bool, fails: bool = False) -> tuple[subprocess.CompletedProcess, Path]:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "python3").write_text(FAKE_PYTHON3)
    (bindir / "python3").chmod(0o755)
    venv = tmp_path / "venv-abc"
    env = {"PATH": f"{bindir}:/usr/bin:/bin", **({"PIP_FAILS": "1"} if fails else {})}
    command = f"umask {CALLER_UMASK:03o} && {build_command(None, str(venv), verbose)}"
    result = subprocess.run(["sh", "-c", command], env=env, capture_output=True, text=True)
    return result, venv


def test_the_build_prints_one_line_and_keeps_pips_output_in_a_0600_log(tmp_path: Any) -> None:
    # Was: pip's Collecting/Downloading lines (240 for LiteLLM's pins) streamed into the converge.
    result, venv = run_build(tmp_path, verbose=False)
    assert result.returncode == 0, result.stderr
    log = venv / PIP_LOG
    assert result.stdout.splitlines() == [
        f"rigup: gateway venv: 2 packages installed, 2 warnings from pip (its configuration on this host); pip's output: {log}"
    ]
    assert result.stderr == ""
    assert "Collecting six==1.0" in log.read_text() and "Successfully installed" in log.read_text()
    assert stat.S_IMODE(log.stat().st_mode) == 0o600  # an index URL from pip.conf may carry credentials
    # pip installs with the caller's umask: under 077 the gateway's user could not read the venv (a real
    # bed's gateway then failed "cannot import name 'run_server' from 'litellm' (unknown location)")
    assert int((venv / "umask-pip-ran-with").read_text(), 8) == CALLER_UMASK
    assert (venv / MARKER).read_text() == "abc\n"


def test_a_failed_build_shows_the_logs_tail_and_leaves_no_marker(tmp_path: Any) -> None:
    result, venv = run_build(tmp_path, verbose=False, fails=True)
    assert result.returncode == 1
    assert "ERROR: THESE PACKAGES DO NOT MATCH THE HASHES" in result.stderr
    assert f"rigup: the gateway's pip install failed; all of its output: {venv / PIP_LOG}" in result.stderr
    assert not (venv / MARKER).exists()


def test_verbose_streams_every_line_of_pips(tmp_path: Any) -> None:
    result, venv = run_build(tmp_path, verbose=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("Collecting ") == 2 and "Successfully installed" in result.stdout
    assert not (venv / PIP_LOG).exists()
