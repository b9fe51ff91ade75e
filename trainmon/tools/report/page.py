"""The HTML of ``trainmon report`` and ``trainmon serve``: one self-contained file (inline CSS and JavaScript).

The page draws everything from the JSON of :func:`trainmon.tools.report.build` (or of ``serve``), embedded in a
``<script type="application/json">`` element: the heatmap views (:mod:`trainmon.tools.report.grids`) on a
``<canvas>`` (one pixel per cell, scaled up) with their labels, step axis and anomaly marks in HTML and SVG, curves
and the anomaly timeline as inline SVG. The view on screen is in the URL's fragment (``#view=steps&family=...``),
so an event links to its rows and a view can be shared. A static page looks its grids up in the page; under
``trainmon serve`` (``"serve": true``) it asks the server's JSON endpoints (relative URLs, the same origin).
A JavaScript error is written into the page (``#js-error`` and ``body[data-js-error]``); a page drawn to the end has
``body[data-rendered="ok"]``, and the heatmap box ``data-ready="ok"`` once its grid is drawn.
"""

from __future__ import annotations

import html
import json
from functools import cache
from importlib.resources import files
from typing import Any


@cache
def _asset(name: str) -> str:
    """``page.css`` or ``page.js`` (beside this module; package data)."""
    return files("trainmon.tools.report").joinpath(name).read_text(encoding="utf-8")


def _controls(prefix: str) -> str:
    return (f'<div class="controls"><label>family <select id="{prefix}-family"></select></label>'
            f'<label>metric <select id="{prefix}-metric"></select></label>'
            f'<label>rank <select id="{prefix}-rank"></select></label></div><div id="{prefix}-map"></div>')


def render(data: dict[str, Any]) -> str:
    """The report page for :func:`trainmon.tools.report.build`'s data."""
    payload = json.dumps(data, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c")
    title = html.escape(f"trainmon report: {data['summary']['run_name']}")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="generator" content="trainmon {html.escape(data['summary']['trainmon'])}">
<title>{title}</title><style>{_asset('page.css')}</style></head>
<body>
<div id="js-error"></div>
<h1>{title}</h1><div id="summary"></div>
<h2>Loss, gradient norm and learning rate</h2>
<div class="controls"><label>rank <select id="curve-rank"></select></label>
<span class="note">red lines: steps with anomaly events (hover: the earliest); red triangles: NaN/Inf values</span>
</div>
<div id="curves"></div>
<h2>Anomalies across ranks</h2><div id="anomaly-summary"></div><div id="timeline"></div>
<table class="events" id="top-events"></table>
<h2 id="heatmaps">Heatmaps</h2>
<div class="note">Rows grouped by layer and block (the strip: attention, MLP, norm, embedding, head). Colour
<b>change</b>: each cell against its row's running median (module x rank: the row's median over the ranks), a log ratio
(red: larger, blue: smaller); <b>value</b>: log10 of |value|. Each column holds the largest and the smallest magnitude
of its steps (a spike is never averaged away). Hover a cell for its values, click it for the other views of it, drag
over columns to zoom. Outlined cells and red triangles: anomaly events.</div>
<div class="controls"><label>view <select id="hm-view"><option value="steps">module x step (one rank)</option>
<option value="ranks">module x rank (one step)</option><option value="module">rank x step (one module)</option>
</select></label>
<label>family <select id="hm-family"></select></label><label>metric <select id="hm-metric"></select></label>
<label id="hm-rank-box">rank <select id="hm-rank"></select></label>
<label id="hm-step-box">step <select id="hm-step"></select><input id="hm-step-input" type="number" min="0"></label>
<label id="hm-module-box">module <select id="hm-module"></select></label>
<label>colour <select id="hm-mode"><option value="change">change vs running median</option>
<option value="abs">value (log scale)</option></select></label>
<label>rows <input id="hm-filter" type="search" placeholder="filter: layers.12. or q_proj or re:..."></label>
<button id="hm-unzoom" type="button">all steps</button></div>
<div id="hm-info" class="note"></div><div id="hm-map"></div><div id="hm-cell"></div><div id="hm-events"></div>
<div id="probe"><h2>Gradient direction (grad probe)</h2>
<div class="note">per parameter and step: agreement of the gradient's direction with the previous collected step
(sign_agree_prev, cos_prev) and with Adam's momentum (…_exp_avg); linear scale, lowest value of each bin</div>
{_controls("probe")}</div>
<h2>Notes</h2><ul id="notes" class="note"></ul>
<div id="tooltip"></div>
<script id="report-data" type="application/json">{payload}</script>
<script>{_asset('page.js')}</script>
</body></html>
"""
