"""rigup: provision consumer-GPU Ubuntu boxes into pinned, verified vLLM serving rigs."""

import compileall
import os
import shutil
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
_CHECKOUT = PACKAGE_DIR.parent
IN_CHECKOUT = (_CHECKOUT / "deploy.py").is_file() and (_CHECKOUT / "group_data" / "all.py").is_file()
# The deploy (deploy.py, tasks/, templates/, files/, group_data/): beside the package in a checkout;
# an installed wheel carries a copy in rigup/_deploy/ (setup.py puts it there).
DEPLOY_ROOT = _CHECKOUT if IN_CHECKOUT else PACKAGE_DIR / "_deploy"
# Where the user's files live (rigs.yaml, rigs.lock.yaml, sandbox/, .cache/): the checkout, or the
# directory rigup runs in ($RIGUP_HOME overrides both).
WORK_DIR = Path(os.environ["RIGUP_HOME"]) if os.environ.get("RIGUP_HOME") else (_CHECKOUT if IN_CHECKOUT else Path.cwd())
REPO_ROOT = DEPLOY_ROOT  # historic name: the directory pyinfra runs the deploy in


def command(tool: str = "rigup") -> str:
    """How to run `tool` (rigup, pyinfra) as written, from a fresh shell in the current directory: the
    program beside the Python that runs rigup (in a checkout `.venv/bin/rigup`: nothing to activate), or
    the bare name when that is what PATH finds (an installed rigup). Every command rigup prints uses it,
    as the README uses `.venv/bin/...` (tests/test_readme.py runs them in a clean shell)."""
    program = Path(sys.executable).parent / tool  # not resolved: a venv's python links to the system's
    if not IN_CHECKOUT and shutil.which(tool) == str(program):
        return tool
    try:
        relative = program.relative_to(Path.cwd())
    except ValueError:
        return str(program)
    return str(relative) if relative.parent != Path(".") else f"./{relative}"


def _cache_own_bytecode() -> None:
    """pyinfra's CLI turns bytecode writing off for its whole process, so that deploy.py and config.py
    leave no .pyc beside them; rigup's own modules would then be compiled from source on every run
    (about 45 of them, 0.2 s of a converged re-run). They are compiled here into the package's
    __pycache__ where stale, as Python itself would have done (a few ms when fresh). The user's own
    choice (-B, PYTHONDONTWRITEBYTECODE) is left alone, and a read-only package is simply skipped."""
    if not sys.dont_write_bytecode or sys.flags.dont_write_bytecode:
        return
    compileall.compile_dir(PACKAGE_DIR, quiet=2)


_cache_own_bytecode()
