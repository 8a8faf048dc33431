"""templates/ rendered by Jinja: one environment, strict about undefined names, the trailing newline kept.

Below every module that renders a template (render.py's variant files, the units of the image mirror, the
cluster's firewall, Grafana, metrics and the gateway): it imports nothing of rigup's but the deploy's root,
so recipe -> cluster -> here is no import cycle.
"""

from __future__ import annotations

import functools

import jinja2

from rigup import DEPLOY_ROOT

TEMPLATES_DIR = DEPLOY_ROOT / "templates"


@functools.cache
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


def render_template(template: str, **values: object) -> str:
    """One of templates/, strict about undefined names."""
    return _environment().get_template(template).render(**values)
