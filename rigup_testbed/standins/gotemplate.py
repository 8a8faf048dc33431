"""A small subset of Go's text/template, enough for `docker ... --format` as tools use it.

Supported: text, `{{.A.B}}`, `{{.}}`, `{{json .X}}`, `{{index .X 0}}` / `{{index .Labels "k"}}`,
`{{join .X ","}}`, `{{len .X}}`, `{{upper/lower/title .X}}`, `{{printf "%s-%d" .A .B}}`, pipelines
(`{{.X | json}}`), `{{range .X}}...{{end}}`, `{{if .X}}...{{else}}...{{end}}`, `{{- ... -}}` trimming.
Unknown fields fail with Go's wording ("can't evaluate field X"), so a wrong format is as loud here as
against the real engine.
"""

from __future__ import annotations

import json
import re

TYPE_CHECKING = False  # typing's own flag, without importing typing
if TYPE_CHECKING:
    from typing import Any

TOKEN = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)


class TemplateError(Exception):
    pass


def go_str(value: Any) -> str:
    """How Go's fmt prints a value with %v."""
    if value is None:
        return "<no value>"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, list):
        return "[" + " ".join(go_str(v) for v in value) + "]"
    if isinstance(value, dict):
        return "map[" + " ".join(f"{k}:{go_str(v)}" for k, v in sorted(value.items())) + "]"
    return str(value)


def to_json(value: Any) -> str:
    # Go's json marshals map keys sorted (docker's template func does not escape HTML)
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, sort_keys=True)


def _printf(fmt: str, *args: Any) -> str:
    out, i, n = [], 0, 0
    while i < len(fmt):
        c = fmt[i]
        if c == "%" and i + 1 < len(fmt):
            verb = fmt[i + 1]
            i += 2
            if verb == "%":
                out.append("%")
                continue
            arg = args[n] if n < len(args) else None
            n += 1
            out.append(json.dumps(str(arg)) if verb == "q" else go_str(arg))
            continue
        out.append(c)
        i += 1
    return "".join(out)


def _index(value: Any, *keys: Any) -> Any:
    for key in keys:
        try:
            value = value[int(key)] if isinstance(value, list) else value[key]
        except (KeyError, IndexError, TypeError, ValueError):
            if isinstance(value, dict):
                return None  # Go returns the zero value for a missing map key
            raise TemplateError(f"error calling index: index out of range: {key}") from None
    return value


FUNCS = {
    "json": to_json,
    "index": _index,
    "join": lambda v, sep: sep.join(go_str(x) for x in (v or [])),
    "len": lambda v: len(v or []),
    "upper": lambda v: go_str(v).upper(),
    "lower": lambda v: go_str(v).lower(),
    "title": lambda v: go_str(v).title(),
    "printf": _printf,
    "println": lambda *a: " ".join(go_str(x) for x in a) + "\n",
    "print": lambda *a: "".join(go_str(x) for x in a),
    "split": lambda v, sep: go_str(v).split(sep),
    "pad": lambda v, a, b: " " * int(a) + go_str(v) + " " * int(b),
    "truncate": lambda v, n: go_str(v)[: int(n)],
}


def _field(dot: Any, path: str, type_name: str) -> Any:
    value = dot
    for part in [p for p in path.split(".") if p]:
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, dict) and type_name.startswith("map"):
            value = None
        else:
            raise TemplateError(f'template: :1: executing "" at <{path}>: can\'t evaluate field {part} in type {type_name}')
    return value


def _operand(tok: str, dot: Any, type_name: str) -> Any:
    if tok.startswith("."):
        return dot if tok == "." else _field(dot, tok, type_name)
    if tok.startswith('"'):
        return json.loads(tok)
    if re.fullmatch(r"-?\d+", tok):
        return int(tok)
    if tok in ("true", "false"):
        return tok == "true"
    raise TemplateError(f'template: :1: function "{tok}" not defined')


def _pipeline(expr: str, dot: Any, type_name: str) -> Any:
    result: Any = None
    first = True
    for cmd in _split_pipes(expr):
        import shlex  # here: most templates are one field

        lex = shlex.shlex(cmd, posix=False)
        lex.whitespace_split = True
        words = list(lex)
        if not words:
            raise TemplateError("template: missing value for command")
        head, args = words[0], [_operand(w, dot, type_name) for w in words[1:]]
        if not first:
            args.append(result)
        if head in FUNCS:
            try:
                result = FUNCS[head](*args)
            except TypeError as exc:
                raise TemplateError(f"template: wrong number of args for {head}: {exc}") from None
        elif not args:
            result = _operand(head, dot, type_name)
        else:
            raise TemplateError(f'template: :1: function "{head}" not defined')
        first = False
    return result


def _split_pipes(expr: str) -> list[str]:
    parts, buf, quoted = [], [], False
    for c in expr:
        if c == '"':
            quoted = not quoted
        if c == "|" and not quoted:
            parts.append("".join(buf).strip())
            buf = []
        else:
            buf.append(c)
    parts.append("".join(buf).strip())
    return parts


def _parse(template: str) -> list[Any]:
    """Nodes: str | ("expr", text) | ("range"|"if", text, body, else_body)."""
    pieces: list[Any] = []
    pos = 0
    for m in TOKEN.finditer(template):
        text = template[pos:m.start()]
        if m.group(1):
            text = text.rstrip()
        if pieces and isinstance(pieces[-1], tuple) and pieces[-1][0] == "trim":
            text = text.lstrip()
            pieces.pop()
        pieces.append(text)
        pieces.append(("tag", m.group(2)))
        if m.group(3):
            pieces.append(("trim",))
        pos = m.end()
    tail = template[pos:]
    if pieces and isinstance(pieces[-1], tuple) and pieces[-1][0] == "trim":
        tail = tail.lstrip()
        pieces.pop()
    pieces.append(tail)
    pieces = [p for p in pieces if not (isinstance(p, tuple) and p[0] == "trim")]

    def block(i: int, stop: tuple[str, ...]) -> tuple[list[Any], int, str]:
        nodes: list[Any] = []
        while i < len(pieces):
            p = pieces[i]
            i += 1
            if isinstance(p, str):
                if p:
                    nodes.append(p)
                continue
            word = p[1].split(None, 1)
            kw = word[0] if word else ""
            if kw in stop:
                return nodes, i, kw
            if kw in ("range", "if"):
                body, i, ended = block(i, ("end", "else"))
                other: list[Any] = []
                if ended == "else":
                    other, i, _ = block(i, ("end",))
                nodes.append((kw, word[1] if len(word) > 1 else "", body, other))
            elif kw in ("end", "else"):
                raise TemplateError(f"template: unexpected {{{{{kw}}}}}")
            else:
                nodes.append(("expr", p[1]))
        if stop:
            raise TemplateError("template: unexpected EOF")
        return nodes, i, ""

    return block(0, ())[0]


def _truthy(v: Any) -> bool:
    return bool(v) and v != "<no value>"


def _render(nodes: list[Any], dot: Any, type_name: str) -> str:
    out = []
    for n in nodes:
        if isinstance(n, str):
            out.append(n)
        elif n[0] == "expr":
            out.append(go_str(_pipeline(n[1], dot, type_name)))
        elif n[0] == "if":
            out.append(_render(n[2] if _truthy(_pipeline(n[1], dot, type_name)) else n[3], dot, type_name))
        elif n[0] == "range":
            seq = _pipeline(n[1], dot, type_name)
            items = list(seq.values() if isinstance(seq, dict) else (seq or []))
            if items:
                out.extend(_render(n[2], item, "interface {}") for item in items)
            else:
                out.append(_render(n[3], dot, type_name))
    return "".join(out)


def render(template: str, dot: Any, type_name: str = "struct") -> str:
    """Execute `template` against `dot` (dicts stand for Go structs; `type_name` goes into errors)."""
    template = template.replace("\\t", "\t").replace("\\n", "\n")
    return _render(_parse(template), dot, type_name)


def render_table(template: str, rows: list[dict[str, Any]], headers: dict[str, str], type_name: str) -> str:
    """`table {{.A}}\\t{{.B}}` as docker prints it: a header row, columns padded like tabwriter."""
    body = template[len("table"):].strip() if template.startswith("table") else template
    body = body.replace("\\t", "\t")
    header_row = re.sub(r"\{\{\s*\.(\w+)\s*\}\}", lambda m: headers.get(m.group(1), m.group(1).upper()), body)
    lines = [header_row] if template.startswith("table") else []
    lines += [render(body, r, type_name) for r in rows]
    if not template.startswith("table"):
        return "".join(line + "\n" for line in lines)
    cells = [line.split("\t") for line in lines]
    widths: dict[int, int] = {}
    for row in cells:
        for i, c in enumerate(row[:-1]):
            widths[i] = max(widths.get(i, 0), len(c))
    return "".join(
        "".join(c.ljust(widths[i] + 3) if i < len(row) - 1 else c for i, c in enumerate(row)).rstrip() + "\n"
        for row in cells
    )
