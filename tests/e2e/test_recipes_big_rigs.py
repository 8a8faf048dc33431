"""Every catalog variant of the four-card, eight-card and H200 rigs comes up on the sandbox, rendered from the
test bed's upstream remotes (tests/e2e/recipes_lineup.py places the catalog; test_recipes.py has the
single-card and dual rigs, and the recipe-pin, refusal and Genesis scenarios). A bed of its own, so the two
halves of the catalog run side by side on two workers.

One bed of four rigs, each in its own group: a 2x3090, a 4x3090, an 8x3090 and a 4xH200 (the recipes that
need sm 9.0, plus duals). Each round switches every rig to its next variant with the real `rigup lock` and
`pyinfra deploy.py`; the health gate, `rigup verify` and the old unit being stopped are checked per rig.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from rigup_testbed.fleet import Testbed
from tests.e2e.recipes_lineup import RecipesBed, every_variant_comes_up_and_verifies, recipes_bed

pytestmark = pytest.mark.e2e

RIGS_HERE = ["rig-2z", "rig-4x", "rig-8x", "rig-h4"]


@pytest.fixture(scope="module")
def bed(testbed_factory: Callable[..., Testbed]) -> Iterator[RecipesBed]:
    yield recipes_bed(testbed_factory, RIGS_HERE, "rigrb")


def test_every_variant_comes_up_and_verifies(bed: RecipesBed) -> None:
    every_variant_comes_up_and_verifies(bed)  # it prints what this disk could not take
