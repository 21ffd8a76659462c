"""The viewer's page: one self-contained HTML file (its data, style and script inline; nothing fetched), and the
object a notebook displays inline.

The page holds an index of the traces and one JSON block per trace, which its script parses only when that trace is
shown, so a study of many traces opens as fast as one.
"""

from __future__ import annotations

import html
import json
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from core.cli import atomic_write
from figures.viewer.views import TraceView

NOTEBOOK_HEIGHT = 720  # pixels of the inline frame in a notebook


def _asset(name: str) -> str:
    return resources.files("figures.viewer").joinpath(name).read_text(encoding="utf-8")


def _script_json(data: object) -> str:
    """JSON that can stand inside a <script> element: "</" can never close it."""
    return json.dumps(data, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")


TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>{css}</style>
</head>
<body>
<header><h1 id="kv-title">{title}</h1><div class="notes" id="kv-notes"></div></header>
<div class="controls">
<label>trace <select id="kv-trace"></select></label>
<label>colour by <select id="kv-quantity"></select></label>
<label>layer <select id="kv-layer"></select></label>
<label>show <select id="kv-mode"><option value="value">value</option><option value="rank">rank</option></select></label>
<label>policy <select id="kv-policy"></select></label>
<label>budget <select id="kv-budget"></select></label>
<label>KV heads <select id="kv-heads"><option value="sum">summed</option><option value="each">one strip each</option>\
</select></label>
</div>
<div class="info" id="kv-info"></div>
<div class="legend" id="kv-legend"></div>
<div id="kv-tokens"></div>
<div class="tip" id="kv-tip" hidden></div>
<script type="application/json" id="kv-index">{index}</script>
{traces}
<script>{js}</script>
</body>
</html>
"""


@dataclass
class Viewer:
    """The trace viewer of some traces: `html()` is the page, `save(path)` writes it, and in a notebook the object
    shows itself inline (an isolated frame holding the page)."""

    title: str
    traces: list[TraceView]
    notes: list[str] = field(default_factory=list)

    def html(self) -> str:
        index = {"title": self.title, "notes": self.notes,
                 "traces": [{"id": t.id, "n_tokens": len(t.tokens), "correct": t.summary.get("correct")}
                            for t in self.traces]}
        blocks = "\n".join(f'<script type="application/json" id="kv-trace-{n}">{_script_json(t.to_json())}</script>'
                           for n, t in enumerate(self.traces))
        return TEMPLATE.format(title=html.escape(self.title), css=_asset("viewer.css"), index=_script_json(index),
                               traces=blocks, js=_asset("viewer.js"))

    def save(self, path: str | os.PathLike) -> Path:
        """Write the page to `path` (atomically); returns it."""
        path = Path(path)
        with atomic_write(path) as handle:
            handle.write(self.html())
        return path

    def _repr_html_(self) -> str:
        return (f'<iframe srcdoc="{html.escape(self.html(), quote=True)}" style="width:100%;height:{NOTEBOOK_HEIGHT}px;'
                'border:1px solid #d2d2d7;border-radius:4px"></iframe>')
