"""rigup: provision consumer-GPU Ubuntu boxes into pinned, verified vLLM serving rigs."""

import os
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
