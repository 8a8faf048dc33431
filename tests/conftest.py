"""Unit tests render variants from the test bed's upstream fixture trees (rigup_testbed/recipes.py),
the same files the test bed's git remotes commit; nothing reaches the network. Subprocesses (rigup,
pyinfra) get the same trees through $RIGUP_UPSTREAM_TREES. The e2e tests read the test bed's git
remotes instead (tests/e2e/conftest.py clears it). The fact records of rigup.pyinfra_patches.fact_batching (what each
host's facts were, for the next run's one-round-trip read) go to a directory of this session, not
the checkout's .cache."""

from __future__ import annotations

import json
import os

import pytest

from rigup.desired.upstream import TREES_ENV, use_reader
from rigup.pyinfra_patches.fact_batching import RECORDS_ENV
from rigup_testbed.recipes import SNAPSHOTS, tree, working_trees


@pytest.fixture(autouse=True, scope="session")
def _upstream_fixture_trees():
    previous_env = os.environ.get(TREES_ENV)
    os.environ[TREES_ENV] = json.dumps({source: str(tree(source)) for source in SNAPSHOTS})
    previous = use_reader(working_trees())
    yield
    use_reader(previous)
    if previous_env is None:
        os.environ.pop(TREES_ENV, None)
    else:
        os.environ[TREES_ENV] = previous_env


@pytest.fixture(autouse=True, scope="session")
def _fact_records_of_this_session(tmp_path_factory: pytest.TempPathFactory):
    previous = os.environ.get(RECORDS_ENV)
    os.environ[RECORDS_ENV] = str(tmp_path_factory.mktemp("fact-records"))
    yield
    if previous is None:
        os.environ.pop(RECORDS_ENV, None)
    else:
        os.environ[RECORDS_ENV] = previous
