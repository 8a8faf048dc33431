"""An upstream compose file as rigup edits it: compose's own interpolation, recorded edits, the audit.

The serving recipe of a variant is upstream's compose file at a pinned commit (the *base*) plus
rigup's named transforms (rigup/desired/transforms.py). Every edit goes through `ComposeEdit`, which
records what it changed, which transform did it and why. `audit(base, rendered_text, changes)`
compares the file rigup ships with upstream's, key by key, independently of the edits, and attributes
each difference to the last recorded change of that key: a difference nobody recorded is
"unexplained" (the bar is zero, for every variant).

Keys are flat and readable: `image`, `environment NCCL_P2P_DISABLE`, `command --max-model-len`,
`volumes /root/.cache/huggingface`, `ports[0]`, `deploy.resources.reservations.devices[0].count`.
A one-string `command` is compared as the words Compose splits it into (command_tokens), plus the key
`command (one string)` that the command-list transform's list form drops.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

# Service keys rigup understands. Anything else in an upstream service fails the render: a key rigup
# does not know could change what runs, and nothing may be dropped silently. (network_mode, devices,
# runtime and pid are left out on purpose: they would bypass the published port or the GPU count.)
# mem_limit and memswap_limit only cap the container's host memory: they are kept as upstream wrote them.
SERVICE_KEYS = frozenset({
    "image", "container_name", "restart", "ports", "volumes", "environment", "shm_size", "ipc", "deploy",
    "entrypoint", "command", "labels", "logging", "ulimits", "healthcheck", "stop_grace_period",
    "security_opt", "cap_add", "working_dir", "init", "tty", "stdin_open", "extra_hosts", "user",
    "mem_limit", "memswap_limit",
})
TOP_KEYS = frozenset({"services", "name"})
# vLLM flags rigup reads or sets: each must appear once, as `--flag VALUE`.
READ_FLAGS = frozenset({
    "--model", "--served-model-name", "--tensor-parallel-size", "--max-model-len", "--gpu-memory-utilization",
    "--max-num-seqs", "--max-num-batched-tokens", "--kv-cache-dtype", "--dtype", "--speculative-config",
    "--port", "--host", "--deploy-config",
})
# The flat key that marks a one-string `command` (see command_tokens); the command-list transform
# writes it as a list, which removes the key.
STRING_COMMAND_KEY = "command (one string)"

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_UNBRACED = re.compile(_NAME)


class ComposeError(ValueError):
    """An upstream compose file rigup cannot render; the message names the file, key and commit."""


@dataclass(frozen=True)
class UpstreamFile:
    """One compose file of an upstream repository at one commit."""

    source: str  # catalog source key, e.g. "club3090"
    url: str
    commit: str  # full sha (or "working tree" when read from a local checkout)
    path: str  # repository path of the compose file
    text: str
    local_tree: str | None = None  # read from this local working tree instead of the commit

    @property
    def where(self) -> str:
        return f"{self.path} at {self.source}@{self.commit[:12]}"

    def parse(self) -> dict[str, Any]:
        try:
            doc = yaml.safe_load(self.text)
        except yaml.YAMLError as exc:
            raise ComposeError(f"{self.where}: not valid YAML: {exc}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("services"), dict) or not doc["services"]:
            raise ComposeError(f"{self.where}: no services")
        for key in doc:
            if key not in TOP_KEYS and not str(key).startswith("x-"):
                raise ComposeError(f"{self.where}: top-level key {key!r} is not understood by rigup's transforms")
        return doc


@dataclass(frozen=True)
class Change:
    """One recorded edit: `key` went from `before` to `after` (None: absent) by `transform`."""

    transform: str
    key: str
    before: Any
    after: Any
    why: str


# ------------------------------------------------------------------------------------------------
# interpolation (Compose v2 semantics)


@dataclass(frozen=True)
class Substitution:
    expression: str  # as written, e.g. "${MAX_MODEL_LEN:-262144}"
    variable: str
    value: str  # compose-literal text it became
    why: str


def interpolate(
    text: str,
    lookup: Callable[[str], str | None],
    keep: Callable[[str], bool],
    where: str,
) -> tuple[str, list[Substitution]]:
    """Resolve `${VAR...}` and `$VAR` in `text` the way Compose v2 does.

    + lookup(name): the value rigup sets for a variable (compose-literal text), None when unset
    + keep(name): the expression stays as written (a secret's: the secrets transform removes the entry naming it)
    `$$` and a `$` before anything but a name or `{` stay as written (compose treats them as literal).
    Unset with no default: `${X}`/`$X` and `${X:?err}` fail (compose would give a blank or stop).
    """
    out: list[str] = []
    subs: list[Substitution] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch != "$":
            out.append(ch)
            i += 1
            continue
        nxt = text[i + 1] if i + 1 < len(text) else ""
        if nxt == "$":
            out.append("$$")
            i += 2
            continue
        if nxt == "{":
            end = _closing_brace(text, i + 2, where)
            expr = text[i:end + 1]
            value, sub = _braced(text[i + 2:end], expr, lookup, keep, where)
            out.append(value)
            subs.extend(sub)
            i = end + 1
            continue
        m = _UNBRACED.match(text, i + 1)
        if m:
            name = m.group(0)
            expr = "$" + name
            if keep(name):
                out.append(expr)
            else:
                value = lookup(name)
                if value is None:
                    raise ComposeError(f"{where}: {expr} has no default and rigup sets no value for it")
                out.append(value)
                subs.append(Substitution(expr, name, value, f"{name} set by rigup"))
            i = m.end()
            continue
        out.append("$")
        i += 1
    return "".join(out), subs


def _closing_brace(text: str, start: int, where: str) -> int:
    depth = 1
    i = start
    while i < len(text):
        if text.startswith("${", i):
            depth += 1
            i += 2
            continue
        if text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise ComposeError(f"{where}: unterminated ${{...}} in {text!r}")


_BRACED = re.compile(rf"^({_NAME})(?:(:?[-+?])(.*))?$", re.S)


def _braced(
    body: str, expr: str, lookup: Callable[[str], str | None], keep: Callable[[str], bool], where: str
) -> tuple[str, list[Substitution]]:
    m = _BRACED.match(body)
    if not m:
        raise ComposeError(f"{where}: {expr} is not an interpolation form rigup understands")
    name, op, rest = m.group(1), m.group(2), m.group(3) or ""
    if keep(name):
        return expr, []
    value = lookup(name)
    # Compose: ":-" / ":+" / ":?" treat empty as unset; "-" / "+" / "?" only unset.
    is_set = value is not None and (value != "" or (op is not None and not op.startswith(":")))
    if op is None:
        if value is None:
            raise ComposeError(f"{where}: {expr} has no default and rigup sets no value for it")
        return value, [Substitution(expr, name, value, f"{name} set by rigup")]
    kind = op[-1]
    if kind == "?":
        if not is_set:
            raise ComposeError(f"{where}: {expr} requires {name}, which rigup does not set")
        return value or "", [Substitution(expr, name, value or "", f"{name} set by rigup")]
    inner, subs = interpolate(rest, lookup, keep, where)
    if kind == "-":
        if is_set:
            return value or "", [Substitution(expr, name, value or "", f"{name} set by rigup")]
        return inner, [*subs, Substitution(expr, name, inner, f"{name} unset: upstream's default")]
    # "+": the alternative when set, else empty
    if is_set:
        return inner, [*subs, Substitution(expr, name, inner, f"{name} set by rigup: upstream's alternative")]
    return "", [Substitution(expr, name, "", f"{name} unset: empty")]


def walk_strings(node: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """(path, string) of every string in a YAML tree, keys excluded; path like `environment[3]`."""
    if isinstance(node, str):
        yield path, node
    elif isinstance(node, Mapping):
        for k, v in node.items():
            yield from walk_strings(v, f"{path}.{k}" if path else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from walk_strings(v, f"{path}[{i}]")


def replace_strings(node: Any, fn: Callable[[str, str], str], path: str = "") -> Any:
    if isinstance(node, str):
        return fn(path, node)
    if isinstance(node, Mapping):
        return {k: replace_strings(v, fn, f"{path}.{k}" if path else str(k)) for k, v in node.items()}
    if isinstance(node, list):
        return [replace_strings(v, fn, f"{path}[{i}]") for i, v in enumerate(node)]
    return node


# ------------------------------------------------------------------------------------------------
# normal form: flat keys


def _env_map(env: Any, where: str) -> dict[str, str | None]:
    if env is None:
        return {}
    if isinstance(env, Mapping):
        return {str(k): None if v is None else str(v) for k, v in env.items()}
    if isinstance(env, list):
        out: dict[str, str | None] = {}
        for item in env:
            name, sep, value = str(item).partition("=")
            out[name] = value if sep else None
        return out
    raise ComposeError(f"{where}: environment must be a list or a mapping")


def parse_volume(spec: Any, where: str) -> dict[str, Any]:
    """A volume entry in long form: type, source, target, read_only, create_host_path."""
    if isinstance(spec, Mapping):
        vtype = spec.get("type", "bind")
        if vtype != "bind":
            raise ComposeError(f"{where}: volume type {vtype!r} is not understood by rigup's transforms")
        unknown = set(spec) - {"type", "source", "target", "read_only", "bind"}
        bind = spec.get("bind") or {}
        if unknown or set(bind) - {"create_host_path"}:
            raise ComposeError(f"{where}: volume keys {sorted(unknown | set(bind))} are not understood")
        return {
            "type": "bind",
            "source": str(spec["source"]),
            "target": str(spec["target"]),
            "read_only": bool(spec.get("read_only", False)),
            "create_host_path": bool(bind.get("create_host_path", True)),
        }
    parts = split_outside_braces(str(spec), ":")
    if len(parts) == 2:
        parts.append("rw")
    if len(parts) != 3 or parts[2] not in ("ro", "rw") or not (parts[1].startswith("/") or parts[1].startswith("$")):
        raise ComposeError(f"{where}: volume {spec!r} is not a bind mount rigup understands (src:dst[:ro])")
    return {"type": "bind", "source": parts[0], "target": parts[1], "read_only": parts[2] == "ro",
            "create_host_path": True}


def split_outside_braces(text: str, sep: str) -> list[str]:
    """Split on `sep` except inside ${...} (a volume's ${MODEL_DIR:-../models} holds a colon)."""
    parts, depth, current = [], 0, []
    i = 0
    while i < len(text):
        if text.startswith("${", i):
            depth += 1
            current.append("${")
            i += 2
            continue
        ch = text[i]
        if ch == "}" and depth:
            depth -= 1
        if ch == sep and not depth:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
        i += 1
    parts.append("".join(current))
    return parts


def command_items(tokens: list[str]) -> list[tuple[str, list[str]]]:
    """vLLM arguments grouped by flag: [("--max-model-len", ["262144"]), ("--trust-remote-code", [])]."""
    items: list[tuple[str, list[str]]] = []
    for token in tokens:
        if token.startswith("--") or not items:
            items.append((token, []))
        else:
            items[-1][1].append(token)
    return items


# Characters whose meaning in a one-string command depends on Compose's shell-word splitter (quotes,
# escapes) or that it stops at (operators, comments): rigup does not reproduce those rules.
_NOT_PLAIN_WORD = re.compile(r"""['"\\`;&|<>()#]""")


def command_tokens(value: Any, where: str) -> list[str]:
    """The words of a service's `command`: a list as written, or a one-string command split the way
    Compose splits it (shell words, no shell).

    rigup reads a one-string command only when it is plain words: no quotes, backslashes, backticks,
    operators or `#`, and no whitespace inside a `${...}` (Compose interpolates before it splits, so
    a default with a space in it would split differently). Anything else fails, naming the file."""
    if value is None:
        return []
    if isinstance(value, list):
        return [str(t) for t in value]
    if not isinstance(value, str):
        raise ComposeError(f"{where}: command must be a list or a string")
    bad = _NOT_PLAIN_WORD.search(value)
    if bad:
        raise ComposeError(f"{where}: a one-string command with {bad.group(0)!r} in it is split by Compose's "
                           f"shell-word rules, which rigup does not reproduce; upstream would have to write it as a list")
    i = value.find("${")
    while i != -1:
        end = _closing_brace(value, i + 2, where)
        if any(c.isspace() for c in value[i:end + 1]):
            raise ComposeError(f"{where}: {value[i:end + 1]!r} in a one-string command holds whitespace: Compose "
                               f"interpolates before it splits words, so rigup cannot tell the words apart")
        i = value.find("${", end + 1)
    return value.split()


def flatten(doc: Mapping[str, Any], where: str = "compose file") -> dict[str, str]:
    """Every leaf of the (single-service) document under a readable key, values as JSON text."""
    out: dict[str, str] = {}
    for key, value in doc.items():
        if key != "services":
            out[f"(top) {key}"] = json.dumps(value, sort_keys=True)
    services = doc.get("services") or {}
    if len(services) != 1:
        raise ComposeError(f"{where}: {len(services)} services; rigup renders single-service files")
    (svc_name, svc), = services.items()
    out["(service name)"] = json.dumps(svc_name)
    for key, value in (svc or {}).items():
        if key == "environment":
            for name, val in _env_map(value, where).items():
                out[f"environment {name}"] = json.dumps(val)
        elif key == "volumes":
            for spec in value or []:
                vol = parse_volume(spec, where)
                out[f"volumes {vol['target']}"] = json.dumps(vol, sort_keys=True)
        elif key == "command":
            if isinstance(value, str):
                out[STRING_COMMAND_KEY] = json.dumps(True)
            seen: dict[str, int] = {}
            for flag, args in command_items(command_tokens(value, where)):
                seen[flag] = seen.get(flag, 0) + 1
                suffix = f" #{seen[flag]}" if seen[flag] > 1 else ""
                out[f"command {flag}{suffix}"] = json.dumps(args)
        elif key == "ports":
            for i, port in enumerate(value or []):
                out[f"ports[{i}]"] = json.dumps(port, sort_keys=True)
        elif isinstance(value, (Mapping, list)) and key != "entrypoint":
            for path, leaf in _leaves(value, key):
                out[path] = json.dumps(leaf, sort_keys=True)
        else:
            out[key] = json.dumps(value, sort_keys=True)
    return out


def _leaves(node: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(node, Mapping) and node:
        for k, v in node.items():
            yield from _leaves(v, f"{path}.{k}")
    elif isinstance(node, list) and node and any(isinstance(v, (Mapping, list)) for v in node):
        for i, v in enumerate(node):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, node


# ------------------------------------------------------------------------------------------------
# recorded edits


class ComposeEdit:
    """The document being rendered, edited only through methods that record a Change."""

    def __init__(self, origin: UpstreamFile, service: str | None = None) -> None:
        self.origin = origin
        self.doc = origin.parse()
        names = list(self.doc["services"])
        if service is None:
            if len(names) != 1:
                raise ComposeError(f"{origin.where}: services {names}: the catalog must name the one to render")
            service = names[0]
        if service not in self.doc["services"]:
            raise ComposeError(f"{origin.where}: no service {service!r} (has {names})")
        # The other services are not rendered: say so in the audit instead of dropping them silently.
        self.changes: list[Change] = []
        for other in names:
            if other != service:
                raise ComposeError(f"{origin.where}: several services ({names}); rigup renders one per file")
        self.service = service
        svc = self.doc["services"][service]
        if not isinstance(svc, dict):
            raise ComposeError(f"{origin.where}: service {service!r} is not a mapping")
        for key in svc:
            if key not in SERVICE_KEYS:
                raise ComposeError(
                    f"{origin.where}: services.{service}.{key} is not understood by rigup's transforms"
                )
        for key in ("command", "entrypoint"):
            for i, token in enumerate(svc.get(key) or []):
                if isinstance(token, bool) or token is None:
                    # PyYAML reads YAML 1.1 (yes/on -> true), Compose YAML 1.2: the two would disagree.
                    raise ComposeError(f"{self.where(f'{key}[{i}]')}: unquoted {token!r} is read differently by "
                                       f"YAML 1.1 and Compose; quote it upstream")
        seen: set[str] = set()
        for flag, _ in command_items(command_tokens(svc.get("command"), self.where("command"))):
            name = flag.split("=", 1)[0]
            if name in READ_FLAGS and ("=" in flag or name in seen):
                why = "--flag=value form" if "=" in flag else "given twice"
                raise ComposeError(f"{self.where('command ' + name)}: {why}; rigup reads and sets this flag, "
                                   f"so it must appear once as `{name} VALUE`")
            seen.add(name)
        env_names = [str(e).partition("=")[0] for e in svc.get("environment") or []] if isinstance(
            svc.get("environment"), list) else []
        twice = sorted({n for n in env_names if env_names.count(n) > 1})
        if twice:
            raise ComposeError(f"{self.where('environment')}: {', '.join(twice)} set twice (the last one wins in "
                               f"Compose); rigup edits environment entries by name")

    @property
    def svc(self) -> dict[str, Any]:
        return self.doc["services"][self.service]

    def where(self, key: str) -> str:
        return f"{self.origin.where}: services.{self.service}.{key}"

    def _mutate(self, transform: str, why: str | Callable[[str], str], fn: Callable[[], None]) -> None:
        """Run fn (which edits self.doc) and record one Change per flat key whose value changed."""
        before = flatten(self.doc, self.origin.where)
        fn()
        after = flatten(self.doc, self.origin.where)
        for key in list(before) + [k for k in after if k not in before]:
            b, a = before.get(key), after.get(key)
            if b != a:
                reason = why(key) if callable(why) else why
                self.changes.append(Change(transform, key, None if b is None else json.loads(b),
                                           None if a is None else json.loads(a), reason))

    # -- whole keys
    def get(self, key: str) -> Any:
        return self.svc.get(key)

    def set(self, key: str, value: Any, transform: str, why: str) -> None:
        """Set a service key (None removes it)."""
        def fn() -> None:
            if value is None:
                self.svc.pop(key, None)
            else:
                self.svc[key] = copy.deepcopy(value)
        self._mutate(transform, why, fn)

    def set_top(self, key: str, value: Any, transform: str, why: str) -> None:
        self._mutate(transform, why, lambda: self.doc.__setitem__(key, value))

    # -- environment (kept in upstream's list form, entry order preserved)
    def env(self) -> dict[str, str | None]:
        return _env_map(self.svc.get("environment"), self.where("environment"))

    def set_env(self, name: str, value: str | None, transform: str, why: str, *, remove: bool = False) -> None:
        """Set `NAME=value` (value None: a bare passthrough entry); remove=True deletes the entry."""
        def fn() -> None:
            raw = self.svc.get("environment")
            if isinstance(raw, Mapping):
                raw = [f"{k}={v}" if v is not None else str(k) for k, v in raw.items()]
            items = list(raw or [])
            idx = next((i for i, item in enumerate(items) if str(item).partition("=")[0] == name), None)
            entry = name if value is None else f"{name}={value}"
            if remove:
                if idx is not None:
                    items.pop(idx)
            elif idx is None:
                items.append(entry)
            else:
                items[idx] = entry
            self.svc["environment"] = items
        self._mutate(transform, why, fn)

    # -- command (vLLM arguments, or a whole `vllm serve MODEL ...` for an image without an entrypoint)
    def command(self) -> list[str]:
        """The command's words (a one-string command split as Compose splits it: command_tokens)."""
        return command_tokens(self.svc.get("command"), self.where("command"))

    def command_as_list(self, transform: str, why: str) -> None:
        """Write a one-string command as the list of its words (nothing to do for a list)."""
        if isinstance(self.svc.get("command"), str):
            words = self.command()
            self._mutate(transform, why, lambda: self.svc.__setitem__("command", words))

    def flag_values(self, flag: str) -> list[str] | None:
        """The arguments after `flag` (first occurrence), None when the flag is absent."""
        for name, args in command_items(self.command()):
            if name == flag:
                return args
        return None

    def set_flag(self, flag: str, values: list[str] | None, transform: str, why: str) -> None:
        """Set `flag`'s arguments (None removes the flag); an absent flag goes before --host."""
        def fn() -> None:
            items = command_items(self.command())
            present = any(n == flag for n, _ in items)
            if values is None:
                items = [(n, a) for n, a in items if n != flag]
            elif not present:
                at = next((i for i, (n, _) in enumerate(items) if n == "--host"), len(items))
                items.insert(at, (flag, list(values)))
            else:
                items = [(n, list(values) if n == flag else a) for n, a in items]
            self.svc["command"] = [t for n, a in items for t in (n, *a)]
        self._mutate(transform, why, fn)

    # -- volumes (long syntax)
    def volumes(self) -> list[dict[str, Any]]:
        return [parse_volume(v, self.where("volumes")) for v in self.svc.get("volumes") or []]

    def set_volumes(self, volumes: list[dict[str, Any]], transform: str, why: Callable[[str], str]) -> None:
        self._mutate(transform, lambda key: why(key.partition(" ")[2]),
                     lambda: self.svc.__setitem__("volumes", [_long_volume(v) for v in volumes]))

    def interpolate(self, fn: Callable[[str, str], tuple[str, list[Substitution]]]) -> None:
        """Rewrite every string of the service through fn(path, text) -> (text, substitutions)."""
        keys = self._flat_keys_of_paths()
        whys: dict[str, list[str]] = {}

        def apply(path: str, text: str) -> str:
            new, subs = fn(path, text)
            if new != text:
                key = keys.get(path, path.split(".")[0].split("[")[0])
                whys.setdefault(key, []).extend(f"{s.expression} -> {s.value!r} ({s.why})" for s in subs)
            return new

        self._mutate("defaults", lambda key: "; ".join(dict.fromkeys(whys.get(key, []))),
                     lambda: self.doc["services"].__setitem__(self.service, replace_strings(self.svc, apply)))

    def _flat_keys_of_paths(self) -> dict[str, str]:
        """String path (as replace_strings names it) -> the flat key it belongs to."""
        out: dict[str, str] = {}
        seen: dict[str, int] = {}
        index = 0
        for flag, args in command_items(self.command()):
            seen[flag] = seen.get(flag, 0) + 1
            key = f"command {flag}" + (f" #{seen[flag]}" if seen[flag] > 1 else "")
            for _ in range(1 + len(args)):
                out[f"command[{index}]"] = key
                index += 1
        env = self.svc.get("environment")
        if isinstance(env, list):
            for i, item in enumerate(env):
                out[f"environment[{i}]"] = f"environment {str(item).partition('=')[0]}"
        elif isinstance(env, Mapping):
            for name in env:
                out[f"environment.{name}"] = f"environment {name}"
        for i, vol in enumerate(self.svc.get("volumes") or []):
            try:
                target = parse_volume(vol, self.where("volumes"))["target"]
            except ComposeError:
                continue
            out[f"volumes[{i}]"] = f"volumes {target}"
            for part in ("source", "target"):
                out[f"volumes[{i}].{part}"] = f"volumes {target}"
        for i in range(len(self.svc.get("ports") or [])):
            out[f"ports[{i}]"] = f"ports[{i}]"
        return out


def _long_volume(v: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "bind", "source": v["source"], "target": v["target"], "read_only": v["read_only"]}
    out["bind"] = {"create_host_path": v["create_host_path"]}
    return out


# ------------------------------------------------------------------------------------------------
# output and audit


class _Dumper(yaml.SafeDumper):
    pass


def _str_presenter(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    if "\n" in data:
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|")
    return dumper.represent_scalar("tag:yaml.org,2002:str", data)


_Dumper.add_representer(str, _str_presenter)


def dump(doc: Mapping[str, Any], header: str) -> str:
    """The document as YAML under a comment header; strings keep compose's escaping as they are."""
    ordered = {k: doc[k] for k in ("name", *[k for k in doc if k != "name"]) if k in doc}
    body = yaml.dump(ordered, Dumper=_Dumper, sort_keys=False, width=100000, allow_unicode=True,
                     default_flow_style=False)
    lines = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    return lines + body


@dataclass(frozen=True)
class AuditLine:
    key: str
    upstream: Any
    rendered: Any
    change: Change | None  # the recorded change that explains it; None: unexplained


def audit(base: UpstreamFile, rendered_text: str, changes: list[Change]) -> list[AuditLine]:
    """Every key where the rendered file differs from upstream's, with the change that explains it."""
    before = flatten(base.parse(), base.where)
    after_doc = yaml.safe_load(rendered_text)
    after = flatten(after_doc, "rendered compose file")
    last: dict[str, Change] = {}
    for change in changes:
        last[change.key] = change
    lines: list[AuditLine] = []
    for key in list(before) + [k for k in after if k not in before]:
        b, a = before.get(key), after.get(key)
        if b == a:
            continue
        change = last.get(key)
        rendered = None if a is None else json.loads(a)
        if change is not None and json.dumps(change.after, sort_keys=True) != json.dumps(rendered, sort_keys=True):
            change = None  # recorded, but the shipped file says something else
        lines.append(AuditLine(key, None if b is None else json.loads(b), rendered, change))
    return lines


def _short(value: Any, limit: int = 160) -> str:
    text = "(absent)" if value is None else value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def explain(base: UpstreamFile, rendered_text: str, changes: list[Change]) -> tuple[list[str], int]:
    """Human lines: every difference from upstream with the transforms that made it; and the number
    of unexplained differences (the bar is 0)."""
    lines = [f"base: {base.path} at {base.url} {base.commit}"
             + (f" (read from the local tree {base.local_tree})" if base.local_tree else "")]
    chains: dict[str, list[Change]] = {}
    for change in changes:
        chains.setdefault(change.key, []).append(change)
    unexplained = 0
    for line in audit(base, rendered_text, changes):
        if line.change is None:
            unexplained += 1
            lines.append(f"  {line.key}: {_short(line.upstream)} -> {_short(line.rendered)}  [UNEXPLAINED]")
            continue
        steps = ", ".join(dict.fromkeys(c.transform for c in chains[line.key]))
        lines.append(f"  {line.key}: {_short(line.upstream)} -> {_short(line.rendered)}  [{steps}]")
        for c in chains[line.key]:
            if c.why:
                lines.append(f"      {c.transform}: {_short(c.why, 200)}")
    lines.append(f"differences: {len(lines) and sum(1 for _ in audit(base, rendered_text, changes))}, "
                 f"unexplained: {unexplained}")
    return lines, unexplained
