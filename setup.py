"""Build hook: the wheel carries the deploy (deploy.py, inventory.py, tasks/, templates/, files/,
group_data/) as rigup/_deploy/, so an installed rigup has its knobs, templates and task files
(rigup.DEPLOY_ROOT). Everything else is in pyproject.toml."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

DEPLOY_FILES = ("deploy.py", "inventory.py", "rigs.example.yaml")
DEPLOY_DIRS = ("tasks", "templates", "files", "group_data")


class BuildWithDeploy(build_py):
    def run(self) -> None:
        super().run()
        here = Path(__file__).resolve().parent
        dest = Path(self.build_lib) / "rigup" / "_deploy"
        dest.mkdir(parents=True, exist_ok=True)
        for name in DEPLOY_FILES:
            shutil.copy2(here / name, dest / name)
        for name in DEPLOY_DIRS:
            shutil.copytree(here / name, dest / name, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


setup(cmdclass={"build_py": BuildWithDeploy})
