"""The HTML of ``trainmon report``: one self-contained file (inline CSS and JavaScript, no network).

The page draws everything from the JSON of :mod:`trainmon.tools.report.data`, embedded in a
``<script type="application/json">`` element: heatmaps on ``<canvas>`` (one pixel per cell, scaled
up), curves and the anomaly timeline as inline SVG. A JavaScript error is written into the page
(``#js-error`` and ``body[data-js-error]``); a page drawn to the end has ``body[data-rendered="ok"]``.
"""

from __future__ import annotations

import html
import json
from typing import Any

_CSS = """
body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 24px 40px; color: #222; }
h1 { font-size: 22px; margin: 16px 0 4px; } h2 { font-size: 17px; margin: 26px 0 8px; border-bottom: 1px solid #ddd; }
#summary, .note { color: #555; font-size: 13px; } .controls { margin: 6px 0; } .controls label { margin-right: 14px; }
select { font: inherit; } #js-error { color: #b00; font-weight: bold; white-space: pre-wrap; }
.chart { margin: 4px 0 10px; } .chart text { font-size: 11px; fill: #444; }
.chart .title { font-size: 13px; fill: #222; }
.axis { stroke: #999; stroke-width: 1; } .grid { stroke: #eee; }
.curve { fill: none; stroke: #1f77b4; stroke-width: 1.3; }
.band { fill: #1f77b4; fill-opacity: 0.25; stroke: none; }
.anomaly-marker { stroke: #d62728; stroke-width: 1; stroke-opacity: 0.55; }
.bad-marker { fill: #d62728; } .first-origin { fill: none; stroke: #000; stroke-width: 2; }
.heat-wrap { display: flex; align-items: flex-start; gap: 6px; } .row-labels { font-size: 10px; text-align: right; }
.row-label { white-space: nowrap; overflow: hidden; max-width: 340px; }
canvas.heatmap { image-rendering: pixelated; image-rendering: crisp-edges; border: 1px solid #ccc; }
#tooltip { position: fixed; pointer-events: none; background: #fff; border: 1px solid #888; padding: 3px 6px;
  font-size: 12px; display: none; z-index: 9; max-width: 520px; white-space: pre-wrap; }
table.events { border-collapse: collapse; font-size: 12px; } table.events td, table.events th { padding: 2px 8px;
  border-bottom: 1px solid #eee; text-align: left; } .legend span { display: inline-block; margin-right: 12px; }
.swatch { display: inline-block; width: 12px; height: 12px; vertical-align: middle; margin-right: 4px;
  border: 1px solid #aaa; }
"""

_JS = r"""
"use strict";
window.onerror = function (message, source, line) {
  document.body.dataset.jsError = String(message) + " (line " + line + ")";
  document.getElementById("js-error").textContent = "Report error: " + message + " (line " + line + ")";
};
const DATA = JSON.parse(document.getElementById("report-data").textContent);
const SVG = "http://www.w3.org/2000/svg";
const CODES = {ZERO: 250, NAN: 251, POS_INF: 252, NEG_INF: 253, MISSING: 255};
const SPECIAL = {250: [217, 217, 217], 251: [228, 26, 28], 252: [255, 127, 0], 253: [152, 78, 163],
  255: [255, 255, 255]};
const VIRIDIS = [[68, 1, 84], [72, 36, 117], [65, 68, 135], [53, 95, 141], [42, 120, 142], [33, 145, 140],
  [34, 168, 132], [68, 191, 112], [122, 209, 81], [189, 223, 38], [253, 231, 37]];
const PALETTE = [];
for (let i = 0; i < 250; i++) {
  const t = i / 249 * (VIRIDIS.length - 1), k = Math.min(Math.floor(t), VIRIDIS.length - 2), f = t - k;
  PALETTE.push(VIRIDIS[k].map((c, j) => Math.round(c + f * (VIRIDIS[k + 1][j] - c))));
}
const tooltip = document.getElementById("tooltip");

function el(tag, attrs, parent, text) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  if (parent) parent.appendChild(node);
  return node;
}
function fmt(x) {
  if (x === null || x === undefined) return "-";
  if (x === 0) return "0";
  const a = Math.abs(x);
  return (a >= 1e5 || a < 1e-3) ? x.toExponential(2) : String(Number(x.toPrecision(4)));
}
function ticks(lo, hi, n) {
  if (!(hi > lo)) return [lo];
  const raw = (hi - lo) / n, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map(m => m * mag).find(s => s >= raw);
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + 1e-9 * step; v += step) out.push(v);
  return out;
}
function showTip(event, text) {
  tooltip.textContent = text; tooltip.style.display = "block";
  tooltip.style.left = (event.clientX + 14) + "px"; tooltip.style.top = (event.clientY + 14) + "px";
}
function hideTip() { tooltip.style.display = "none"; }
function stepRange(first, perBin, last) {
  return perBin > 1 ? "steps " + first + ".." + last + " (" + perBin + " collected steps)" : "step " + first;
}

// ---- curves ----
function globalSteps() {
  let lo = Infinity, hi = -Infinity;
  for (const rank of Object.keys(DATA.curves)) for (const c of Object.values(DATA.curves[rank])) {
    if (c.steps.length) { lo = Math.min(lo, c.steps[0]); hi = Math.max(hi, c.steps[c.steps.length - 1]); }
  }
  for (const m of DATA.anomalies.markers) { lo = Math.min(lo, m.step); hi = Math.max(hi, m.step); }
  return isFinite(lo) ? [lo, Math.max(hi, lo + 1)] : [0, 1];
}
function drawCurve(parent, name, c, xRange) {
  const W = 920, H = 170, L = 64, R = 12, T = 20, B = 24;
  const svg = el("svg:svg", {width: W, height: H, class: "chart curve-chart", "data-name": name,
    "data-points": c.steps.length, "data-per-bin": c.per_bin}, parent);
  const values = c.lo.concat(c.hi).filter(v => v !== null);
  const positive = values.length && values.every(v => v > 0);
  let yLo = values.length ? Math.min(...values) : 0, yHi = values.length ? Math.max(...values) : 1;
  const log = positive && name !== "loss" && yHi / yLo > 100;
  const fy = log ? Math.log10 : (v => v);
  yLo = fy(yLo); yHi = fy(yHi);
  if (!(yHi > yLo)) { const pad = Math.abs(yLo) * 0.5 || 1; yHi = yLo + pad; yLo -= pad; }
  const x = s => L + (s - xRange[0]) / (xRange[1] - xRange[0]) * (W - L - R);
  const y = v => T + (1 - (fy(v) - yLo) / (yHi - yLo)) * (H - T - B);
  for (const t of ticks(yLo, yHi, 4)) {
    const yy = T + (1 - (t - yLo) / (yHi - yLo)) * (H - T - B);
    el("svg:line", {x1: L, x2: W - R, y1: yy, y2: yy, class: "grid"}, svg);
    el("svg:text", {x: L - 4, y: yy + 4, "text-anchor": "end"}, svg, log ? "1e" + t : fmt(t));
  }
  for (const t of ticks(xRange[0], xRange[1], 8)) {
    if (Math.abs(t - Math.round(t)) > 1e-9) continue;
    el("svg:text", {x: x(t), y: H - 8, "text-anchor": "middle"}, svg, String(t));
  }
  el("svg:line", {x1: L, x2: L, y1: T, y2: H - B, class: "axis"}, svg);
  el("svg:line", {x1: L, x2: W - R, y1: H - B, y2: H - B, class: "axis"}, svg);
  el("svg:text", {x: L, y: 13, class: "title"}, svg, name + (log ? " (log scale)" : "") +
    (c.per_bin > 1 ? " - min and max of every " + c.per_bin + " points" : ""));
  const segments = [];
  let current = [];
  c.steps.forEach((s, i) => {
    if (c.lo[i] === null) { if (current.length) segments.push(current); current = []; }
    else current.push(i);
  });
  if (current.length) segments.push(current);
  for (const seg of segments) {
    const upper = seg.map(i => x(c.steps[i]).toFixed(1) + "," + y(c.hi[i]).toFixed(1));
    if (c.per_bin > 1) {
      const lower = seg.slice().reverse().map(i => x(c.steps[i]).toFixed(1) + "," + y(c.lo[i]).toFixed(1));
      el("svg:path", {d: "M" + upper.concat(lower).join("L") + "Z", class: "band"}, svg);
    }
    el("svg:path", {d: "M" + upper.join("L"), class: "curve"}, svg);
  }
  for (const s of c.bad) {
    const xx = x(s);
    el("svg:path", {d: `M${xx - 4},${T} L${xx + 4},${T} L${xx},${T + 7} Z`, class: "bad-marker", "data-step": s}, svg)
      .appendChild(el("svg:title", {}, null, name + " is NaN or Inf at step " + s));
  }
  for (const m of DATA.anomalies.markers) {
    const line = el("svg:line", {x1: x(m.step), x2: x(m.step), y1: T, y2: H - B, class: "anomaly-marker",
      "data-step": m.step, "data-detector": m.detector}, svg);
    el("svg:title", {}, line, "step " + m.step + ", rank " + m.rank + " [" + m.detector + "]: " + m.message);
  }
}
function drawCurves() {
  const box = document.getElementById("curves"), rank = document.getElementById("curve-rank").value;
  box.textContent = "";
  const curves = DATA.curves[rank] || {};
  const names = Object.keys(curves);
  if (!names.length) { el("p", {class: "note"}, box, "No loss, grad_norm or lr in scalars.csv of this rank."); return; }
  const order = n => n === "loss" ? 0 : n === "grad_norm" ? 1 : n.startsWith("lr/") ? 2 : 3;
  names.sort((a, b) => order(a) - order(b) || a.localeCompare(b));
  const xRange = globalSteps();
  for (const name of names) drawCurve(box, name, curves[name], xRange);
}

// ---- anomalies ----
function drawAnomalies() {
  const a = DATA.anomalies, box = document.getElementById("anomaly-summary");
  if (!a.present) { box.textContent = "No anomalies.jsonl in this run: no anomaly was recorded."; return; }
  const f = a.first_origin;
  const where = e => "step " + e.step + ", micro-step " + e.micro_step + ", rank " + e.rank + ", " + e.phase + " of " +
    e.name + " (" + e.metric + " = " + e.value + ") [" + e.detector + "]";
  box.textContent = a.events + " anomaly events in " + a.files + " file(s)" +
    (a.detectors ? " of detector(s) " + a.detectors.join(", ") : "") +
    (Object.keys(a.by_detector).length
      ? " (" + Object.entries(a.by_detector).map(([d, n]) => d + ": " + n).join(", ") + ")" : "") + ". ";
  if (f) el("b", {id: "first-origin-text", "data-step": f.step, "data-rank": f.rank}, box, "First origin: " + where(f));
  // The first NaN/Inf and the first spike, apart: a rule firing from step 1 must not hide where the NaN began.
  for (const [key, title] of [["first_nonfinite", "First non-finite"], ["first_spike", "First spike"]]) {
    const e = a[key];
    el("div", {id: key.replace("_", "-") + "-text", "data-step": e ? e.step : "", "data-rank": e ? e.rank : ""}, box,
      title + ": " + (e ? where(e) : "none"));
  }
  const cells = a.timeline.cells;
  const svgBox = document.getElementById("timeline");
  if (!cells.length) return;
  const ranks = Array.from(new Set(cells.map(c => c[0]).concat(DATA.ranks))).sort((p, q) => p - q);
  const rowH = Math.max(3, Math.min(16, 320 / ranks.length));
  const W = 920, L = 64, R = 12, T = 20, B = 24, H = T + B + rowH * ranks.length;
  const xRange = globalSteps();
  const x = s => L + (s - xRange[0]) / (xRange[1] - xRange[0]) * (W - L - R);
  const rowOf = new Map(ranks.map((r, i) => [r, i]));
  const svg = el("svg:svg", {width: W, height: H, class: "chart", id: "timeline-svg"}, svgBox);
  el("svg:text", {x: L, y: 13, class: "title"}, svg, "anomaly events per rank and step" +
    (a.timeline.per_bin > 1 ? " (bins of " + a.timeline.per_bin + " steps with events)" : ""));
  const maxCount = Math.max(...cells.map(c => c[2]));
  const width = Math.max(2, (W - L - R) / Math.max(1, (xRange[1] - xRange[0]) / Math.max(1, a.timeline.per_bin)));
  for (const [rank, step, count] of cells) {
    const shade = 0.35 + 0.65 * Math.log(1 + count) / Math.log(1 + maxCount);
    const rect = el("svg:rect", {x: x(step) - width / 2, y: T + rowOf.get(rank) * rowH, width: width,
      height: Math.max(1, rowH - 1),
      fill: "#d62728", "fill-opacity": shade.toFixed(2), class: "timeline-cell", "data-rank": rank, "data-step": step,
      "data-count": count}, svg);
    el("svg:title", {}, rect, count + " event(s): rank " + rank + ", step " + step);
  }
  ranks.forEach((r, i) => { if (ranks.length <= 40 || i % Math.ceil(ranks.length / 40) === 0)
    el("svg:text", {x: L - 4, y: T + i * rowH + rowH / 2 + 4, "text-anchor": "end"}, svg, "rank " + r); });
  for (const t of ticks(xRange[0], xRange[1], 8)) {
    if (Math.abs(t - Math.round(t)) < 1e-9) {
      el("svg:text", {x: x(t), y: H - 8, "text-anchor": "middle"}, svg, String(t));
    }
  }
  if (f && rowOf.has(f.rank)) {
    const ring = el("svg:circle", {cx: x(f.step), cy: T + rowOf.get(f.rank) * rowH + rowH / 2,
      r: Math.max(5, rowH / 2 + 2),
      class: "first-origin", "data-step": f.step, "data-rank": f.rank}, svg);
    el("svg:title", {}, ring, "first origin: " + f.message);
  }
  const table = document.getElementById("top-events");
  const head = el("tr", {}, el("thead", {}, table));
  for (const h of ["rank", "step", "micro", "phase", "name", "metric", "value", "detector"]) el("th", {}, head, h);
  const body = el("tbody", {}, table);
  for (const e of a.top) {
    const tr = el("tr", {class: "event-row"}, body);
    for (const v of [e.rank, e.step, e.micro_step, e.phase, e.name, e.metric, e.value, e.detector]) {
      el("td", {}, tr, String(v));
    }
  }
}

// ---- heatmaps ----
function decode(text) {
  const bin = atob(text), out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}
function cellValue(hm, code) {
  if (code === CODES.ZERO) return "0"; if (code === CODES.NAN) return "NaN";
  if (code === CODES.POS_INF) return "+Inf"; if (code === CODES.NEG_INF) return "-Inf";
  if (code === CODES.MISSING) return "no value";
  const t = hm.lo + code / 249 * (hm.hi - hm.lo);
  return hm.scale === "log" ? "|value| ~ " + fmt(Math.pow(10, t)) : "~ " + fmt(t);
}
function drawHeatmap(box, hm) {
  box.textContent = "";
  const rows = hm.rows.length, cols = hm.steps.length, codes = decode(hm.data);
  const rowH = Math.max(1, Math.min(14, Math.floor(900 / rows)));
  const cellW = Math.max(1, Math.min(22, Math.floor(900 / cols)));
  const wrap = el("div", {class: "heat-wrap"}, box);
  const labels = el("div", {class: "row-labels"}, wrap);
  const right = el("div", {}, wrap);
  const canvas = el("canvas", {class: "heatmap", width: cols, height: rows}, right);
  canvas.style.width = (cols * cellW) + "px"; canvas.style.height = (rows * rowH) + "px";
  const ctx = canvas.getContext("2d"), image = ctx.createImageData(cols, rows);
  let nonfinite = 0;
  for (let i = 0; i < codes.length; i++) {
    const code = codes[i], rgb = code < 250 ? PALETTE[code] : SPECIAL[code];
    if (code >= 251 && code <= 253) nonfinite++;
    image.data[4 * i] = rgb[0]; image.data[4 * i + 1] = rgb[1]; image.data[4 * i + 2] = rgb[2];
    image.data[4 * i + 3] = 255;
  }
  ctx.putImageData(image, 0, 0);
  Object.assign(canvas.dataset, {rows: rows, cols: cols, nonfinite: nonfinite, family: hm.family,
    metric: hm.metric, rank: hm.rank});
  if (rowH >= 9) {
    labels.style.paddingTop = "1px";
    for (const name of hm.rows) {
      const d = el("div", {class: "row-label", "data-family": hm.family}, labels, name);
      d.style.height = rowH + "px"; d.style.lineHeight = rowH + "px";
    }
  } else {
    el("div", {class: "note"}, labels, rows + " rows: hover for names");
  }
  const axis = el("div", {class: "note"}, right);
  axis.textContent = "x: " + stepRange(hm.steps[0], 1, hm.steps[0]) + " .. " + hm.last_step + "; " +
    (hm.per_bin > 1 ? "each column is " + hm.per_bin + " consecutive collected steps; "
      : "one column per collected step; ") +
    (hm.reduce === "min" ? "a cell is the lowest value of its steps"
      : "a cell is the value of largest magnitude over its steps and micro-steps (NaN/Inf win)");
  canvas.addEventListener("mousemove", ev => {
    const r = Math.floor(ev.offsetY / rowH), c = Math.floor(ev.offsetX / cellW);
    if (r < 0 || r >= rows || c < 0 || c >= cols) return hideTip();
    const last = c + 1 < cols ? hm.steps[c + 1] - 1 : hm.last_step;
    showTip(ev, hm.rows[r] + "\n" + stepRange(hm.steps[c], hm.per_bin, last) + ": " +
      cellValue(hm, codes[r * cols + c]));
  });
  canvas.addEventListener("mouseleave", hideTip);
  const legend = el("div", {class: "legend note"}, right);
  const bar = el("canvas", {width: 250, height: 1, class: "colourbar"}, legend);
  bar.style.width = "250px"; bar.style.height = "12px"; bar.style.verticalAlign = "middle";
  const bctx = bar.getContext("2d"), bimg = bctx.createImageData(250, 1);
  PALETTE.forEach((rgb, i) => { bimg.data.set([rgb[0], rgb[1], rgb[2], 255], 4 * i); });
  bctx.putImageData(bimg, 0, 0);
  const span = el("span", {}, legend, hm.scale === "log"
    ? " |value| " + fmt(Math.pow(10, hm.lo)) + " .. " + fmt(Math.pow(10, hm.hi)) + " (log scale)"
    : " " + fmt(hm.lo) + " .. " + fmt(hm.hi) + " (linear)");
  span.style.marginRight = "16px";
  for (const [code, label] of [[250, "0"], [251, "NaN"], [252, "+Inf"], [253, "-Inf"], [255, "no value"]]) {
    const item = el("span", {}, legend); const sw = el("span", {class: "swatch"}, item);
    sw.style.background = "rgb(" + SPECIAL[code].join(",") + ")"; item.appendChild(document.createTextNode(label));
  }
}
function setupHeatmaps(prefix, list) {
  const family = document.getElementById(prefix + "-family"), metric = document.getElementById(prefix + "-metric");
  const rank = document.getElementById(prefix + "-rank"), box = document.getElementById(prefix + "-map");
  const fill = (select, values, label) => { const keep = select.value; select.textContent = "";
    for (const v of values) el("option", {value: v}, select, label ? label(v) : String(v));
    if (values.map(String).includes(keep)) select.value = keep; };
  const uniq = xs => Array.from(new Set(xs));
  const update = () => {
    fill(metric, uniq(list.filter(h => h.family === family.value).map(h => h.metric)));
    const shown = list.filter(h => h.family === family.value && h.metric === metric.value);
    // a family written once per data-parallel group: the writer's rows stand for the group's ranks
    fill(rank, uniq(shown.map(h => h.rank)), r => {
      const h = shown.find(x => x.rank === r);
      return h && h.for_ranks ? r + " (for ranks " + h.for_ranks + ")" : String(r); });
    const hm = list.find(h => h.family === family.value && h.metric === metric.value && String(h.rank) === rank.value);
    if (hm) drawHeatmap(box, hm);
  };
  fill(family, uniq(list.map(h => h.family)));
  for (const s of [family, metric, rank]) s.addEventListener("change", update);
  update();
}

function main() {
  const s = DATA.summary;
  document.getElementById("summary").textContent = s.run_dir + ": " + DATA.ranks.length + " rank(s), steps " +
    s.first_step +
    ".." + s.last_step + ", " + s.files + " files read; written by trainmon " + s.trainmon + " on " + s.generated + ".";
  const curveRank = document.getElementById("curve-rank");
  for (const r of Object.keys(DATA.curves)) el("option", {value: r}, curveRank, "rank " + r);
  curveRank.addEventListener("change", drawCurves);
  drawCurves();
  drawAnomalies();
  if (DATA.heatmaps.length) setupHeatmaps("heat", DATA.heatmaps);
  else document.getElementById("heat-map").textContent = "No statistics CSV files in this run.";
  if (DATA.probe.length) setupHeatmaps("probe", DATA.probe);
  else document.getElementById("probe").style.display = "none";
  for (const n of DATA.notes) el("li", {}, document.getElementById("notes"), n);
  document.body.dataset.rendered = "ok";
}
main();
"""


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
<title>{title}</title><style>{_CSS}</style></head>
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
<h2>Module x step heatmaps</h2>
<div class="note">colour: log10 of |value| (the grid's own range); grey 0, red NaN, orange +Inf, purple -Inf,
white no value</div>
{_controls("heat")}
<div id="probe"><h2>Gradient direction (grad probe)</h2>
<div class="note">per parameter and step: agreement of the gradient's direction with the previous collected step
(sign_agree_prev, cos_prev) and with Adam's momentum (…_exp_avg); linear scale, lowest value of each bin</div>
{_controls("probe")}</div>
<h2>Notes</h2><ul id="notes" class="note"></ul>
<div id="tooltip"></div>
<script id="report-data" type="application/json">{payload}</script>
<script>{_JS}</script>
</body></html>
"""
