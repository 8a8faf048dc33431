"""Parsers for apt-cache policy and apt source files (one-line and deb822)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Literal

from rigup.parsers.common import JsonDataclass, ParseError, split_lines


@dataclass(frozen=True)
class AptPolicy(JsonDataclass):
    installed: str | None
    candidate: str | None


def parse_apt_cache_policy(output: str | Iterable[str]) -> dict[str, AptPolicy]:
    """Parse `apt-cache policy PKG...`: package -> installed and candidate versions.

    Packages apt has never heard of are simply absent (apt-cache prints nothing for them).
    """
    out: dict[str, AptPolicy] = {}
    current: str | None = None
    installed: str | None = None
    candidate: str | None = None
    for line in split_lines(output):
        if not line.strip():
            continue
        if not line[0].isspace() and line.rstrip().endswith(":"):
            if current is not None:
                out[current] = AptPolicy(installed, candidate)
            current, installed, candidate = line.strip()[:-1], None, None
            continue
        stripped = line.strip()
        if current is None:
            # apt-cache prints nothing before the first package; anything else is an error text
            raise ParseError(f"apt-cache policy: unexpected line before any package: {stripped!r}")
        if stripped.startswith("Installed:"):
            value = stripped.split(":", 1)[1].strip()
            installed = None if value == "(none)" else value
        elif stripped.startswith("Candidate:"):
            value = stripped.split(":", 1)[1].strip()
            candidate = None if value == "(none)" else value
    if current is not None:
        out[current] = AptPolicy(installed, candidate)
    return out


@dataclass(frozen=True)
class AptSource(JsonDataclass):
    file: str
    line: int  # 1-based line of the entry (one-line) or of the stanza's first field (deb822)
    format: Literal["one-line", "deb822"]
    types: tuple[str, ...]
    uris: tuple[str, ...]
    suites: tuple[str, ...]
    components: tuple[str, ...]
    options: dict[str, str] = field(default_factory=dict)  # keys lower-case: signed-by, arch, ...
    enabled: bool = True
    stanzas_in_file: int = 1  # deb822: how many stanzas the file holds (one-line: entries)
    text: str = ""  # the raw line (one-line entries)
    enabled_line: int | None = None  # deb822: line of an explicit Enabled field

    @property
    def signed_by(self) -> str | None:
        return self.options.get("signed-by")


_ONE_LINE = re.compile(r"^(?P<type>deb|deb-src)\s+(?:\[(?P<opts>[^\]]*)\]\s+)?(?P<rest>.+)$")


def _parse_one_line(path: str, number: int, raw: str) -> AptSource | None:
    text = raw.split("#", 1)[0].strip() if not raw.lstrip().startswith("#") else ""
    if not text:
        return None
    match = _ONE_LINE.match(text)
    if match is None:
        raise ParseError(f"{path}:{number}: not an apt source line: {raw!r}")
    options: dict[str, str] = {}
    for opt in (match.group("opts") or "").split():
        key, _, value = opt.partition("=")
        options[key.lower().rstrip("+-")] = value
    rest = match.group("rest").split()
    if len(rest) < 2:
        raise ParseError(f"{path}:{number}: apt source line needs a URI and a suite: {raw!r}")
    return AptSource(
        file=path,
        line=number,
        format="one-line",
        types=(match.group("type"),),
        uris=(rest[0],),
        suites=(rest[1],),
        components=tuple(rest[2:]),
        options=options,
        text=raw,
    )


_DEB822_LIST_KEYS = {"types", "uris", "suites", "components"}


def _parse_deb822(path: str, lines: list[str]) -> list[AptSource]:
    # (first field line, fields, line of the Enabled field)
    stanzas: list[tuple[int, dict[str, str], int | None]] = []
    current: dict[str, str] = {}
    start = 0
    enabled_at: int | None = None
    last_key: str | None = None
    for number, raw in enumerate(lines, start=1):
        if raw.startswith("#"):
            continue
        if not raw.strip():
            if current:
                stanzas.append((start, current, enabled_at))
            current, last_key, enabled_at = {}, None, None
            continue
        if raw[0] in " \t":
            if last_key is None:
                raise ParseError(f"{path}:{number}: continuation line outside a field")
            current[last_key] += "\n" + raw.strip()  # e.g. an inline Signed-By key block
            continue
        key, sep, value = raw.partition(":")
        if not sep:
            raise ParseError(f"{path}:{number}: not a deb822 field: {raw!r}")
        if not current:
            start = number
        last_key = key.strip().lower()
        if last_key == "enabled":
            enabled_at = number
        current[last_key] = value.strip()
    if current:
        stanzas.append((start, current, enabled_at))
    out: list[AptSource] = []
    for start, fields, enabled_line in stanzas:
        options = {k: v for k, v in fields.items() if k not in _DEB822_LIST_KEYS | {"enabled"}}
        if "architectures" in options:
            options["arch"] = options.pop("architectures")
        out.append(
            AptSource(
                file=path,
                line=start,
                format="deb822",
                types=tuple(fields.get("types", "").split()),
                uris=tuple(fields.get("uris", "").split()),
                suites=tuple(fields.get("suites", "").split()),
                components=tuple(fields.get("components", "").split()),
                options=options,
                enabled=fields.get("enabled", "yes").strip().lower() not in ("no", "false", "0"),
                stanzas_in_file=len(stanzas),
                enabled_line=enabled_line,
            )
        )
    return out


def parse_apt_source_files(output: str | Iterable[str]) -> tuple[AptSource, ...]:
    """Parse files printed as `==> PATH` headers followed by their content.

    Files ending in .sources are deb822; everything else is one-line format.
    """
    files: list[tuple[str, list[str]]] = []
    for line in split_lines(output):
        if line.startswith("==> "):
            files.append((line[4:].strip(), []))
        elif files:
            files[-1][1].append(line)
        elif line.strip():
            raise ParseError(f"apt source content before any file header: {line!r}")
    out: list[AptSource] = []
    for path, lines in files:
        if path.endswith(".sources"):
            out.extend(_parse_deb822(path, lines))
            continue
        entries = [e for n, raw in enumerate(lines, start=1) if (e := _parse_one_line(path, n, raw)) is not None]
        out.extend(
            AptSource(**{**asdict(e), "stanzas_in_file": len(entries)})  # type: ignore[arg-type]
            for e in entries
        )
    return tuple(out)

