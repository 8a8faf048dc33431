"""Facts about apt: package policies (candidate versions by origin) and the source entries on the rig."""

from __future__ import annotations

import shlex

from pyinfra.api import FactBase

from rigup.facts.util import parse_fact_output
from rigup.parsers.apt import AptPolicy, AptSource, parse_apt_cache_policy, parse_apt_source_files


class AptPolicies(FactBase[dict[str, AptPolicy]]):
    """
    ``apt-cache policy`` for some packages: installed and candidate version of each; a package
    apt does not know (no list entry) is absent from the result.

    + packages: package names
    """

    default = dict

    def command(self, packages: list[str]) -> str:
        names = " ".join(shlex.quote(p) for p in packages)
        return f"apt-cache policy {names} 2>/dev/null || true"

    def process(self, output: list[str]) -> dict[str, AptPolicy]:
        return parse_fact_output(output, parse_apt_cache_policy)


class AptSourceEntries(FactBase[tuple[AptSource, ...]]):
    """
    Every apt source entry on the host, one-line (``*.list``, ``sources.list``) and deb822
    (``*.sources``), with its file, line, URIs, suites and options (``signed-by``...).
    """

    default = tuple
    command = (
        "for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; "
        'do if [ -f "$f" ]; then echo "==> $f"; cat "$f"; echo; fi; done'
    )

    def process(self, output: list[str]) -> tuple[AptSource, ...]:
        return parse_fact_output(output, parse_apt_source_files)

