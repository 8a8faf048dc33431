"""The test bed's offline PyPI mirror (rigup_testbed/pypi.py): which requirement lines apply to the
test-bed hosts, the PEP 503 layout and hashes, the cache (a second build needs no network, a new key
reuses wheels already held), and real pip installing from the index over HTTP with --require-hashes.

The index is built from PyPI (or whatever index the machine's pip is configured for) once per module,
for two small pure-Python pins; "unreachable" runs point pip at a closed port with no config files.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import subprocess
import sys
import types
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rigup_testbed import pypi
from rigup_testbed.hub import PORTS, Hub
from rigup_testbed.hubserve import StaticHandler
from rigup_testbed.service import BackgroundServer

# Two small pure-Python pins (hashes of wheel and sdist, as files/gateway/requirements.txt has them),
# and a Windows-only line whose hash is bogus: were it downloaded, pip's hash check would fail the build.
TINY_REQUIREMENTS = """\
# two small pins for the mirror's tests
six==1.17.0 \\
    --hash=sha256:4721f391ed90541fddacab5acf947aa0d3dc7d27b2e1e8eda2be8970586c3274 \\
    --hash=sha256:ff70335d468e7eb6ec65b95b99d3a2836546063f63acc5171de367e834932a81
colorama==0.4.6 ; sys_platform == 'win32' \\
    --hash=sha256:0000000000000000000000000000000000000000000000000000000000000000
mdurl==0.1.2 ; python_full_version >= '3.8' \\
    --hash=sha256:84008a41e51615a49fc9966191ff91509e3c40b939176e643fd50a5c2196b8f8 \\
    --hash=sha256:bb413d29f5eea38f31dd4754dd7377d4465116fb207585f97bf925588687c1ba
"""
SIX_WHEEL_SHA256 = "4721f391ed90541fddacab5acf947aa0d3dc7d27b2e1e8eda2be8970586c3274"
MDURL_WHEEL_SHA256 = "84008a41e51615a49fc9966191ff91509e3c40b939176e643fd50a5c2196b8f8"


def _hashes(n: int) -> str:
    return f" \\\n    --hash=sha256:{hashlib.sha256(str(n).encode()).hexdigest()}"


def _unreachable_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """pip sees only an index on a closed port: no config files (which may add indexes or find-links),
    no cache, no retries."""
    for name in list(os.environ):
        if name.startswith("PIP_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "2")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(requirements file, out_dir, served dir) of the tiny index, built once from the network."""
    base = tmp_path_factory.mktemp("pypi")
    requirements = base / "requirements.txt"
    requirements.write_text(TINY_REQUIREMENTS)
    out_dir = base / "cache"
    return requirements, out_dir, pypi.build_index(requirements, out_dir)


class RecordingHandler(StaticHandler):
    requested: list[str] = []

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        self.requested.append(self.path)


@pytest.fixture
def served(tiny: tuple[Path, Path, Path]) -> Iterator[tuple[str, list[str]]]:
    """The tiny index over HTTP on 127.0.0.1 by hubserve's static server: (base URL, paths requested)."""
    requested: list[str] = []
    handler = type("Handler", (RecordingHandler,), {"requested": requested})
    server = BackgroundServer("127.0.0.1", 0, functools.partial(handler, directory=str(tiny[2])), "pypi-test")
    server.start()
    try:
        yield f"http://127.0.0.1:{server.port}", requested
    finally:
        server.stop()


# --- which lines apply -------------------------------------------------------------------------


def test_markers_are_evaluated_for_the_debian12_hosts() -> None:
    text = (
        "# comment line\n"
        "always==1.0" + _hashes(1) + "\n"
        "older==1.0 ; python_full_version < '3.11'" + _hashes(2) + "\n"
        "numpy==2.4.6 ; python_full_version == '3.11.*'" + _hashes(3) + "\n"
        "newer==3.0 ; python_full_version >= '3.12'" + _hashes(4) + "\n"
        "colorama==0.4.6 ; sys_platform == 'win32'" + _hashes(5) + "\n"
        "async-timeout==5.0.1 ; python_full_version < '3.11.3'" + _hashes(6) + "\n"
        "Hf_Xet==1.8.0 ; platform_machine == 'AMD64' or platform_machine == 'x86_64'" + _hashes(7) + _hashes(8) + "\n"
        "pywin32==312 ; sys_platform == 'win32'" + _hashes(9) + "  # trailing comment\n"
        "litellm[proxy]==1.108.7" + _hashes(10) + "\n"
    )
    pins = pypi.parse_requirements(text)
    assert len(pins) == 9
    selected = {p.name: p for p in pypi.select_pins(pins)}
    # 3.11.2, not the interpreter running the test: async-timeout (< 3.11.3) is needed there.
    assert sorted(selected) == ["always", "async-timeout", "hf-xet", "litellm", "numpy"]
    assert selected["hf-xet"].hashes == (hashlib.sha256(b"7").hexdigest(), hashlib.sha256(b"8").hexdigest())
    assert selected["litellm"].line() == f"litellm[proxy]==1.108.7 --hash=sha256:{hashlib.sha256(b'10').hexdigest()}"
    assert selected["numpy"].marker == 'python_full_version == "3.11.*"'


def test_selection_follows_the_given_environment() -> None:
    text = ("older==1.0 ; python_full_version < '3.11'" + _hashes(1) + "\n"
            "newer==3.0 ; python_full_version >= '3.12'" + _hashes(2) + "\n"
            "colorama==0.4.6 ; sys_platform == 'win32'" + _hashes(3) + "\n")  # fmt: skip
    pins = pypi.parse_requirements(text)
    assert pypi.select_pins(pins) == []
    py312 = {**pypi.TARGET_ENVIRONMENT, "python_full_version": "3.12.3", "python_version": "3.12"}
    assert [p.name for p in pypi.select_pins(pins, py312)] == ["newer"]
    windows = {**pypi.TARGET_ENVIRONMENT, "sys_platform": "win32", "python_full_version": "3.10.12"}
    assert [p.name for p in pypi.select_pins(pins, windows)] == ["older", "colorama"]


@pytest.mark.parametrize(
    "text, error",
    [
        ("six>=1.16" + _hashes(1), "not pinned"),
        ("six==1.*" + _hashes(1), "not pinned"),
        ("six==1.17.0\n", "no --hash"),
        ("six==1.17.0 --hash=md5:abc\n", "unsupported option"),
        ("-e git+https://example.invalid/six.git#egg=six\n", "not a requirement"),
        ("six==1.17.0" + _hashes(1) + "\nSix==1.16.0 ; os_name == 'posix'" + _hashes(2) + "\n", "pinned twice"),
    ],
)
def test_lines_the_mirror_cannot_serve_are_errors(text: str, error: str) -> None:
    with pytest.raises(pypi.IndexBuildError, match=error):
        pypi.select_pins(pypi.parse_requirements(text))


# --- the built index ---------------------------------------------------------------------------


def test_index_layout_and_hashes(tiny: tuple[Path, Path, Path]) -> None:
    _, out_dir, root = tiny
    assert root.parent == out_dir.resolve() and root.name == pypi.index_key(TINY_REQUIREMENTS)
    top = (root / "simple/index.html").read_text()
    assert re.findall(r'href="([^"]+)"', top) == ["mdurl/", "six/"]  # colorama is Windows-only
    assert not (root / "simple/colorama").exists()
    expected = {"six": ("six-1.17.0-py2.py3-none-any.whl", SIX_WHEEL_SHA256),
                "mdurl": ("mdurl-0.1.2-py3-none-any.whl", MDURL_WHEEL_SHA256)}  # fmt: skip
    for project, (filename, digest) in expected.items():
        page = (root / "simple" / project / "index.html").read_text()
        links = re.findall(r'href="([^"]+)"', page)
        assert links == [f"../../packages/{filename}#sha256={digest}"]
        # The link resolves, from the project page's URL, to the file, whose bytes have that hash.
        url = urllib.parse.urljoin(f"http://hub/simple/{project}/", links[0].split("#")[0])
        target = root / urllib.parse.urlsplit(url).path.lstrip("/")
        assert hashlib.sha256(target.read_bytes()).hexdigest() == digest
    assert sorted(p.name for p in (root / "packages").iterdir()) == sorted(f for f, _ in expected.values())
    assert "colorama" not in (root / "requirements.txt").read_text()


def test_second_build_needs_no_network(tiny: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch,
                                       tmp_path: Path) -> None:
    requirements, out_dir, root = tiny
    _unreachable_env(monkeypatch)

    def no_subprocess(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"a cached build ran {args}")

    with monkeypatch.context() as m:
        m.setattr(subprocess, "Popen", no_subprocess)
        assert pypi.build_index(requirements, out_dir) == root
    # The same requirements into an empty cache must download, and fail loudly with pip's error.
    with pytest.raises(pypi.IndexBuildError, match=r"(?s)pip download failed.*six==1\.17\.0"):
        pypi.build_index(requirements, tmp_path / "empty-cache")
    # Nothing but the lock file and pip's log: no half build left behind.
    left = sorted(p.name for p in (tmp_path / "empty-cache").iterdir())
    assert left == [f".{root.name}.lock", f"build-{root.name}.log"]
    assert "six==1.17.0" in (tmp_path / "empty-cache" / f"build-{root.name}.log").read_text()


def test_new_key_links_the_wheels_it_already_holds(tiny: tuple[Path, Path, Path],
                                                   monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _, out_dir, root = tiny
    _unreachable_env(monkeypatch)
    changed = tmp_path / "requirements.txt"
    changed.write_text(TINY_REQUIREMENTS.replace("# two small pins", "# only six now").split("colorama")[0])
    other = pypi.build_index(changed, out_dir)
    assert other != root
    assert sorted(p.name for p in (other / "packages").iterdir()) == ["six-1.17.0-py2.py3-none-any.whl"]
    wheel = "packages/six-1.17.0-py2.py3-none-any.whl"
    assert (other / wheel).samefile(root / wheel)


def test_pip_installs_the_pins_from_the_served_index(tiny: tuple[Path, Path, Path], served: tuple[str, list[str]],
                                                     tmp_path: Path) -> None:
    requirements, _, _ = tiny
    base, requested = served
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    # Only the served index: no config files, indexes or find-links of this machine.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | {"PIP_CONFIG_FILE": os.devnull}
    result = subprocess.run(
        [str(venv / "bin/pip"), "install", "--disable-pip-version-check", "--no-cache-dir", "--require-hashes",
         "--no-deps", "-r", str(requirements), "--index-url", f"{base}/simple"],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert {"/packages/six-1.17.0-py2.py3-none-any.whl", "/packages/mdurl-0.1.2-py3-none-any.whl"} <= set(requested)
    versions = subprocess.run(
        [str(venv / "bin/python"), "-c", "import importlib.metadata as m; print(m.version('six'), m.version('mdurl'))"],
        check=True, capture_output=True, text=True,
    ).stdout.split()
    assert versions == ["1.17.0", "0.1.2"]


# --- what a build prints ------------------------------------------------------------------------


def test_a_build_prints_two_lines_and_counts_the_machines_pip_warnings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       capfd: pytest.CaptureFixture[str]) -> None:
    """Was: every line of pip's relayed (449 `pypi:` lines for the gateway's pins, 210 of them this
    machine's pip configuration warning about an extra index that is not there, once per project)."""
    config = tmp_path / "pip.conf"  # as this machine's /etc/pip.conf: an extra index that does not exist
    config.write_text(f"[global]\nextra-index-url = file://{tmp_path}/no-such-index/simple\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(config))
    monkeypatch.delenv(pypi.VERBOSE_ENV, raising=False)
    requirements = tmp_path / "requirements.txt"
    requirements.write_text(TINY_REQUIREMENTS)
    root = pypi.build_index(requirements, tmp_path / "cache")
    err = capfd.readouterr().err
    lines = err.splitlines()
    log = tmp_path / "cache" / f"build-{root.name}.log"
    assert len(lines) == 2 and all(line.startswith("pypi: ") for line in lines), err
    assert f"pip's output: {log}" in lines[0] and "downloading 2" in lines[0]
    assert lines[1].startswith("pypi: mirror built: 2 wheels") and f"(log: {log})" in lines[1]
    assert '2 x "Location \'...\' is ignored' in lines[1], lines[1]  # one per project, counted once
    assert "Collecting six==1.17.0" in log.read_text() and "WARNING: Location" in log.read_text()


def test_verbose_relays_every_line_of_pips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capfd: pytest.CaptureFixture[str]) -> None:
    canned = ("Looking in indexes: https://pypi.org/simple\n"
              "WARNING: Location 'file:///x/simple/six/' is ignored: it is neither a file nor a directory.\n"
              "Collecting six==1.17.0\n  Downloading six-1.17.0-py2.py3-none-any.whl (11 kB)\n")
    real_popen = subprocess.Popen
    monkeypatch.setattr(pypi.subprocess, "Popen", lambda cmd, **kw: real_popen(
        [sys.executable, "-c", f"import sys; sys.stdout.write({canned!r})"], **kw))
    pin = pypi.parse_requirements(TINY_REQUIREMENTS)[0]
    for verbose, expected in (("0", []), ("1", ["pypi:   pip: Looking in indexes: https://pypi.org/simple",
                                                "pypi:   pip: WARNING: Location 'file:///x/simple/six/' is ignored: it "
                                                "is neither a file nor a directory.",
                                                "pypi: [1/1] six==1.17.0",
                                                "pypi:     Downloading six-1.17.0-py2.py3-none-any.whl (11 kB)"])):
        monkeypatch.setenv(pypi.VERBOSE_ENV, verbose)
        log = tmp_path / f"build-{verbose}.log"
        warnings = pypi._pip_download([pin], tmp_path, tmp_path, log)
        assert capfd.readouterr().err.splitlines() == expected
        assert warnings == [canned.splitlines()[1]] and canned in log.read_text()
    assert pypi.warnings_summary(warnings * 3) == '3 x "Location \'...\' is ignored: it is neither a file nor a directory."'


# --- the hub service ---------------------------------------------------------------------------


def test_hub_serves_the_index_on_its_port(tmp_path: Path) -> None:
    hub = Hub(tmp_path, "10.213.0.1")
    hub.repo_info = types.SimpleNamespace(root=tmp_path / "apt-root")  # the apt service's, not looked at
    hub.pypi_root = tmp_path / "pypi-root"
    svc = next(s for s in hub._plan() if s.name == "pypi")
    assert PORTS["pypi"] == 8083
    assert svc.module == "rigup_testbed.hubserve" and svc.args[0] == "static"
    args = dict(zip(svc.args[1::2], svc.args[2::2]))
    assert args == {"--root": str(hub.pypi_root), "--bind": "10.213.0.1", "--port": "8083",
                    "--ready-file": str(tmp_path / "pypi/ready.json")}  # fmt: skip
    assert svc.knobs({"url": "http://10.213.0.1:8083"}) == {"gateway_pip_index_url": "http://10.213.0.1:8083/simple"}
