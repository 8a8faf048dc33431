"""How facts run rigup's rig-side Python scripts (rigup.facts.util.python_script): main(argv) gets the
arguments and its exit status is the command's, and the script's bytecode is kept beside it, so a
converged re-run does not compile rigup-servingctl again each time; rigfetch.py, a zipapp, is run by path and
keeps its own modules' bytecode beside it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pyinfra.api import QuoteString, StringCommand

from rigup.facts.model import ModelFiles
from rigup.facts.serving import ServingStatus
from rigup.facts.util import python_script
from rigup.rig.onefile import rigfetch_sha256, write_rigfetch
from rigup.rig.rigfetch.manifest import encode_manifest

SCRIPT = '''#!/usr/bin/env python3
import sys

def main(argv):
    print("argv", argv)
    return int(argv[0]) if argv and argv[0].isdigit() else 0

if __name__ == "__main__":
    print("run as a script")
    sys.exit(main(sys.argv[1:]))
'''


def _run(command: StringCommand) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"
    return subprocess.run(["sh", "-c", command.get_raw_value()], capture_output=True, text=True, env=env, timeout=60)


def test_main_gets_the_arguments_and_the_bytecode_is_kept(tmp_path: Path) -> None:
    script = tmp_path / "rigup-tool"  # no .py, as rigup-servingctl
    script.write_text(SCRIPT)
    proc = _run(StringCommand(*python_script(QuoteString(str(script)), "3", QuoteString("it's spaced"))))
    assert (proc.returncode, proc.stdout) == (3, "argv ['3', \"it's spaced\"]\n"), proc.stderr
    cached = list((tmp_path / "__pycache__").iterdir())
    assert len(cached) == 1 and cached[0].name.startswith("rigup-tool")
    # a new version of the script is what runs next (the cache follows the source's mtime and size)
    script.write_text(SCRIPT.replace('print("argv", argv)', 'print("v2", argv)'))
    os.utime(script, (1, 1))
    assert _run(StringCommand(*python_script(QuoteString(str(script))))).stdout == "v2 []\n"


def test_the_facts_run_rigs_scripts_so(tmp_path: Path) -> None:
    ctl = tmp_path / "rigup-servingctl"
    ctl.write_bytes((Path(__file__).resolve().parents[2] / "rigup/rig/servingctl.py").read_bytes())
    proc = _run(ServingStatus().command(str(ctl), str(tmp_path / "missing/release.json")))
    assert proc.returncode == 0 and ServingStatus().process(proc.stdout.splitlines()) == {
        "release_present": False, "serving": False}
    assert (tmp_path / "__pycache__").is_dir()
    fetch = write_rigfetch(tmp_path)
    manifest = encode_manifest({"version": 1, "state_dir": str(tmp_path / "state"), "models": []})
    proc = _run(ModelFiles().command(str(fetch), rigfetch_sha256(), manifest))
    assert proc.returncode == 0, proc.stderr
    assert ModelFiles().process(proc.stdout.splitlines())["files"] == 0
    # the zipapp keeps its modules' bytecode beside it (rigup/rig/rigfetch/__main__.py)
    assert (tmp_path / "__pycache__" / f"rigfetch.py.{sys.implementation.cache_tag}" / "rigfetch.cli.pyc").is_file()
