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
  if (f && eventHash(f)) {
    el("a", {href: eventHash(f), class: "event-link", id: "first-origin-link"}, box, " (show rows)");
  }
  // The first NaN/Inf and the first spike, apart: a rule firing from step 1 must not hide where the NaN began.
  for (const [key, title] of [["first_nonfinite", "First non-finite"], ["first_spike", "First spike"]]) {
    const e = a[key];
    el("div", {id: key.replace("_", "-") + "-text", "data-step": e ? e.step : "", "data-rank": e ? e.rank : ""}, box,
      title + ": " + (e ? where(e) : "none"));
  }
  const cells = a.timeline.cells;
  const svgBox = document.getElementById("timeline");
  if (!cells.length) return;
  const perRank = a.timeline.per_rank || 1, rankZero = cells.reduce((m, c) => Math.min(m, c[0]), Infinity);
  const binOf = r => perRank > 1 ? Math.floor((r - rankZero) / perRank) * perRank + rankZero : r;
  const ranks = Array.from(new Set(cells.map(c => c[0]).concat(DATA.ranks.filter(r => r >= rankZero).map(binOf))))
    .sort((p, q) => p - q);
  const rowH = Math.max(2, Math.min(16, 320 / ranks.length));
  const W = 920, L = 64, R = 12, T = 20, B = 24, H = T + B + rowH * ranks.length;
  const xRange = globalSteps();
  const x = s => L + (s - xRange[0]) / (xRange[1] - xRange[0]) * (W - L - R);
  const rowOf = new Map(ranks.map((r, i) => [r, i]));
  const svg = el("svg:svg", {width: W, height: H, class: "chart", id: "timeline-svg"}, svgBox);
  el("svg:text", {x: L, y: 13, class: "title"}, svg, "anomaly events per rank and step" +
    (perRank > 1 ? " (" + perRank + " ranks per row)" : "") +
    (a.timeline.per_bin > 1 ? " (bins of " + a.timeline.per_bin + " steps with events)" : ""));
  const maxCount = cells.reduce((m, c) => Math.max(m, c[2]), 1);
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
    el("svg:text", {x: L - 4, y: T + i * rowH + rowH / 2 + 4, "text-anchor": "end"}, svg,
      perRank > 1 ? "ranks " + r + "-" + (r + perRank - 1) : "rank " + r); });
  for (const t of ticks(xRange[0], xRange[1], 8)) {
    if (Math.abs(t - Math.round(t)) < 1e-9) {
      el("svg:text", {x: x(t), y: H - 8, "text-anchor": "middle"}, svg, String(t));
    }
  }
  if (f && rowOf.has(binOf(f.rank))) {
    const ring = el("svg:circle", {cx: x(f.step), cy: T + rowOf.get(binOf(f.rank)) * rowH + rowH / 2,
      r: Math.max(5, rowH / 2 + 2),
      class: "first-origin", "data-step": f.step, "data-rank": f.rank}, svg);
    el("svg:title", {}, ring, "first origin: " + f.message);
  }
  const table = document.getElementById("top-events");
  const head = el("tr", {}, el("thead", {}, table));
  for (const h of ["rank", "step", "micro", "phase", "name", "metric", "value", "detector", ""]) el("th", {}, head, h);
  const body = el("tbody", {}, table);
  for (const e of a.top) {
    const tr = el("tr", {class: "event-row"}, body);
    for (const v of [e.rank, e.step, e.micro_step, e.phase, e.name, e.metric, e.value, e.detector]) {
      el("td", {}, tr, String(v));
    }
    const hash = eventHash(e);
    if (hash) el("a", {href: hash, class: "event-link", "data-step": e.step, "data-rank": e.rank}, el("td", {}, tr),
      "show rows");
  }
}

// ---- heatmap views: module x step of a rank, module x rank at a step, rank x step of a module ----
const VIEW_SPECIAL = {250: [120, 120, 120], 251: [0, 0, 0], 252: [255, 0, 255], 253: [0, 190, 190],
  255: [226, 226, 226]};
const KIND_COLOURS = [[66, 133, 244], [52, 168, 83], [170, 170, 170], [161, 98, 7], [117, 112, 179],
  [255, 255, 255]];
const KIND_NAMES = ["attention", "mlp", "norm", "embedding", "head", "other"];
const CHANGE_STOPS = [[5, 48, 97], [33, 102, 172], [146, 197, 222], [247, 247, 247], [244, 165, 130],
  [214, 96, 77], [103, 0, 31]];
const CHANGE_PALETTE = [];
for (let i = 0; i < 249; i++) {
  const t = i / 248 * (CHANGE_STOPS.length - 1), k = Math.min(Math.floor(t), CHANGE_STOPS.length - 2), f = t - k;
  CHANGE_PALETTE.push(CHANGE_STOPS[k].map((c, j) => Math.round(c + f * (CHANGE_STOPS[k + 1][j] - c))));
}
const VIEW_NAMES = {steps: "module x step (one rank)", ranks: "module x rank (one step)",
  module: "rank x step (one module)"};
const CAT = DATA.catalog || {families: {}, default: {}};
const state = {view: "steps", family: CAT.default.family, metric: CAT.default.metric, rank: CAT.default.rank,
  step: null, module: null, mode: "change", filter: "", lo: null, hi: null, row: "", at: null};
const EMBEDDED = new Map();
const ROWSETS = Object.assign({}, DATA.rowsets || {});
let current = null, dragFrom = null;

function gridKey(view, family, metric, at) { return [view, family, metric, at].join("|"); }
function moduleKey(m) { return m[0] + ":" + m[1]; }
for (const g of DATA.grids || []) {
  EMBEDDED.set(gridKey(g.view, g.family, g.metric, g.view === "module" ? moduleKey(g.module) : g.at), g);
}
function codesOf(g, mode) {
  g._codes = g._codes || {};
  if (!g._codes[mode]) g._codes[mode] = decode(g[mode].data);
  return g._codes[mode];
}
function axisStarts(axis) { return axis.steps || axis.ranks; }
function colRange(axis, c) { const s = axisStarts(axis)[c]; return [s, Math.min(s + axis.width - 1, axis.last)]; }
function colOf(axis, value) {
  const starts = axisStarts(axis);
  let lo = 0, hi = starts.length - 1, found = -1;
  while (lo <= hi) {
    const mid = (lo + hi) >> 1;
    if (starts[mid] <= value) { found = mid; lo = mid + 1; } else hi = mid - 1;
  }
  return found >= 0 && value <= starts[found] + axis.width - 1 ? found : -1;
}
function rangeText(kind, a, b) {
  return (kind === "steps" ? "step" : "rank") + (a === b ? " " + a : "s " + a + ".." + b);
}
function reference(g) {
  return g.view === "ranks" ? "the row's median over the ranks"
    : "the row's running median (previous " + g.change.window + " columns)";
}
function changeText(g, code) {
  if (code > 248) return absText(g, code);
  const d = (code - 124) / 124 * g.change.range, ratio = Math.pow(10, d);
  const clip = Math.abs(code - 124) === 124 ? (d > 0 ? ">= " : "<= ") : "";
  return clip + "x" + (ratio >= 100 || ratio < 0.01 ? ratio.toExponential(1) : Number(ratio.toPrecision(3))) + " vs " +
    reference(g);
}
function absText(g, code) {
  if (code === 250) return "0"; if (code === 251) return "NaN"; if (code === 252) return "+Inf";
  if (code === 253) return "-Inf"; if (code === 255) return "no value";
  return "|value| ~ " + fmt(Math.pow(10, g.abs.lo + code / 249 * (g.abs.hi - g.abs.lo)));
}
function eventLabel(e) { return e.vpp_stage ? e.name + " (vpp " + e.vpp_stage + ")" : e.name; }
const EVENTS = (function () {
  const seen = new Set(), out = [];
  for (const e of (DATA.anomalies.top || []).concat(DATA.anomalies.markers || [])) {
    const key = [e.step, e.rank, e.micro_step, e.name, e.detector].join("|");
    if (!seen.has(key)) { seen.add(key); out.push(e); }
  }
  return out;
})();
function familyOf(name) { return CAT.families[name] ? name : CAT.default.family; }
function eventHash(e) {
  const family = familyOf(e.family);
  if (!family) return null;
  const metrics = CAT.families[family].metrics;
  return "#" + new URLSearchParams({view: "steps", family: family, metric: metrics.includes(e.metric) ? e.metric
    : metrics[0], rank: e.rank, row: family === e.family && e.name ? eventLabel(e) : "", at: e.step,
    mode: state.mode}).toString();
}
function eventText(e) {
  return "step " + e.step + ", rank " + e.rank + (e.name ? ", " + e.name : "") + " [" + e.detector + "]: " + e.message;
}

function rowInfo(g) {
  if (g.view === "module") {
    const ax = g.rank_rows;
    const labels = ax.ranks.map(s => ax.width > 1 ? "ranks " + s + ".." + Math.min(s + ax.width - 1, ax.last)
      : "rank " + s);
    return {labels: labels, groups: labels, group: labels.map((_, i) => i), blocks: null, kinds: null};
  }
  const rs = g.rowset || ROWSETS[g.family];
  return {labels: rs.names, groups: rs.groups, group: rs.group, blocks: rs.block, kinds: rs.kind};
}
function visibleRows(info) {
  const text = state.filter.trim();
  const all = info.labels.map((_, i) => i);
  if (!text) return all;
  let test;
  if (text.startsWith("re:")) {
    let re = null;
    try { re = new RegExp(text.slice(3)); } catch (err) { re = null; }
    test = s => re !== null && re.test(s);
  } else {
    const low = text.toLowerCase();
    test = s => s.toLowerCase().includes(low);
  }
  return all.filter(i => test(info.labels[i]) || test(info.groups[info.group[i]]));
}
function lookupGrid() {
  const at = state.view === "steps" ? state.rank : state.view === "ranks" ? state.step : state.module;
  return EMBEDDED.get(gridKey(state.view, state.family, state.metric, at)) || null;
}
function embeddedAts(view) {
  const out = [];
  for (const g of DATA.grids || []) {
    if (g.view === view && g.family === state.family && g.metric === state.metric) {
      out.push(view === "module" ? moduleKey(g.module) : g.at);
    }
  }
  return out;
}

function fill(select, values, labelOf) {
  const keep = select.value;
  select.textContent = "";
  for (const v of values) el("option", {value: v}, select, labelOf ? labelOf(v) : String(v));
  if (values.map(String).includes(String(keep))) select.value = keep;
}
function syncControls() {
  const $ = id => document.getElementById(id);
  const families = Object.keys(CAT.families);
  if (!families.includes(state.family)) state.family = CAT.default.family;
  const fam = CAT.families[state.family];
  if (!fam) return;
  if (!fam.metrics.includes(state.metric)) state.metric = fam.metrics[0];
  fill($("hm-family"), families); $("hm-family").value = state.family;
  fill($("hm-metric"), fam.metrics); $("hm-metric").value = state.metric;
  $("hm-view").value = state.view; $("hm-mode").value = state.mode;
  if ($("hm-filter").value !== state.filter) $("hm-filter").value = state.filter;
  const inPage = new Set(embeddedAts("steps").map(String));
  if (!fam.ranks.includes(Number(state.rank))) state.rank = fam.ranks.includes(CAT.default.rank) ? CAT.default.rank
    : fam.ranks[0];
  fill($("hm-rank"), fam.ranks, r => "rank " + r + (DATA.serve || inPage.has(String(r)) ? "" : " (not in page)"));
  $("hm-rank").value = state.rank;
  if (DATA.serve) {
    if (state.step === null) state.step = fam.last_step;
    $("hm-step-input").value = state.step;
    const rows = ROWSETS[state.family];
    if (rows) {
      const keys = rows.names.map((n, i) => moduleKey([rowVpp(rows, i), rowName(rows, i)]));
      if (state.module === null) state.module = keys[0];
      if (!keys.includes(state.module)) keys.push(state.module);
      fill($("hm-module"), keys, k => k.slice(k.indexOf(":") + 1) + (k.startsWith("0:") ? "" : " (vpp " +
        k.slice(0, k.indexOf(":")) + ")"));
      $("hm-module").value = state.module;
    }
  } else {
    const steps = embeddedAts("ranks").sort((p, q) => p - q);
    if (!steps.includes(Number(state.step))) state.step = steps.length ? nearest(steps, Number(state.at) || 0) : null;
    fill($("hm-step"), steps); if (state.step !== null) $("hm-step").value = state.step;
    const modules = embeddedAts("module");
    if (!modules.includes(state.module)) state.module = modules.length ? modules[0] : null;
    fill($("hm-module"), modules, k => k.slice(k.indexOf(":") + 1));
    if (state.module !== null) $("hm-module").value = state.module;
  }
  $("hm-rank-box").style.display = state.view === "steps" ? "" : "none";
  $("hm-step-box").style.display = state.view === "ranks" ? "" : "none";
  $("hm-module-box").style.display = state.view === "module" ? "" : "none";
  $(DATA.serve ? "hm-step" : "hm-step-input").style.display = "none";
  $("hm-unzoom").style.display = state.lo !== null && state.view !== "ranks" ? "" : "none";
}
function rowName(rows, i) {
  const n = rows.names[i], m = / \(vpp (\d+)\)$/.exec(n);
  return m ? n.slice(0, m.index) : n;
}
function rowVpp(rows, i) { const m = / \(vpp (\d+)\)$/.exec(rows.names[i]); return m ? Number(m[1]) : 0; }
function nearest(values, target) {
  return values.reduce((best, v) => Math.abs(v - target) < Math.abs(best - target) ? v : best, values[0]);
}

function readHash() {
  const p = new URLSearchParams(location.hash.slice(1));
  for (const key of ["view", "family", "metric", "mode", "filter", "row", "module"]) {
    if (p.has(key)) state[key] = p.get(key);
  }
  for (const key of ["rank", "step", "at", "lo", "hi"]) {
    if (p.has(key)) state[key] = p.get(key) === "" || isNaN(Number(p.get(key))) ? null : Number(p.get(key));
  }
  if (!VIEW_NAMES[state.view]) state.view = "steps";
  if (state.mode !== "abs") state.mode = "change";
  if (!p.has("row")) state.row = "";
  if (!p.has("at")) state.at = null;
  if (!p.has("lo")) { state.lo = null; state.hi = null; }
}
function writeHash() {
  const p = {view: state.view, family: state.family, metric: state.metric, mode: state.mode};
  if (state.view === "steps") p.rank = state.rank;
  if (state.view === "ranks" && state.step !== null) p.step = state.step;
  if (state.view === "module" && state.module !== null) p.module = state.module;
  if (state.filter) p.filter = state.filter;
  if (state.row) p.row = state.row;
  if (state.at !== null) p.at = state.at;
  if (state.lo !== null) { p.lo = state.lo; p.hi = state.hi; }
  history.replaceState(null, "", "#" + new URLSearchParams(p).toString());
}
function go(changes) {
  Object.assign(state, changes);
  writeHash();
  updateView(true);
}

function ensureRows(family) {
  if (!DATA.serve || ROWSETS[family] || !CAT.families[family]) return Promise.resolve();
  return fetchJson("api/rows?" + new URLSearchParams({family: family}).toString()).then(r => { ROWSETS[family] = r; });
}
function updateView(scroll) {
  syncControls();
  const box = document.getElementById("hm-map");
  if (!CAT.families[state.family]) { box.textContent = "No statistics in this run."; return; }
  if (DATA.serve) {
    box.dataset.ready = "loading";
    const rows = state.view === "module" ? ensureRows(state.family) : Promise.resolve();  // the others bring theirs
    rows.then(() => { syncControls(); return fetchGrid(); }).then(g => { syncControls(); showGrid(g, scroll); })
      .catch(err => { box.textContent = "Could not load this view: " + err.message; box.dataset.ready = "error"; });
    return;
  }
  const g = lookupGrid();
  if (g) { showGrid(g, scroll); return; }
  box.textContent = "";
  const at = state.view === "steps" ? "rank " + state.rank : state.view === "ranks" ? "step " + state.step
    : "module " + state.module;
  el("p", {class: "missing-grid"}, box, "This view (" + VIEW_NAMES[state.view] + ", " + state.family + " " +
    state.metric + ", " + at + ") is not in this page: the page keeps the most telling heatmaps within its size " +
    "limit (trainmon report --max-size, --ranks, --families, --metrics). trainmon serve RUN shows every view, at " +
    "full resolution.");
  const ats = embeddedAts(state.view);
  if (ats.length) el("p", {class: "note"}, box, "In this page: " + ats.join(", "));
  box.dataset.ready = "missing";
  document.getElementById("hm-events").textContent = "";
}
function fetchGrid() {
  const p = {view: state.view, family: state.family, metric: state.metric};
  if (state.view === "steps") p.rank = state.rank;
  if (state.view === "ranks") p.step = state.step;
  if (state.view === "module") p.module = state.module;
  if (state.lo !== null && state.view !== "ranks") { p.lo = state.lo; p.hi = state.hi; }
  return fetchJson("api/grid?" + new URLSearchParams(p).toString()).then(g => {
    if (g.rowset) ROWSETS[g.family] = g.rowset;
    if (g.view === "ranks") state.step = g.at;
    return g;
  });
}
function fetchJson(url) {
  return fetch(url).then(r => r.json().then(j => { if (!r.ok) throw new Error(j.error || r.statusText); return j; }));
}

const MAX_ROWS = 1000;  // more rows (after the filter) are drawn a row per layer and block (the farthest cell of each)

function condense(g, info, vis) {
  // Runs of rows of one layer and block become one row holding, per column, the member farthest from no change
  // (change) or the largest (value); NaN, then +Inf, then -Inf win. Too many runs: runs of consecutive rows.
  let runs = [];
  for (const i of vis) {
    const key = info.group[i] + "|" + (info.blocks ? info.blocks[i] : "");
    const last = runs[runs.length - 1];
    if (last && last.key === key) last.members.push(i); else runs.push({key: key, members: [i]});
  }
  if (runs.length > MAX_ROWS) {
    const size = Math.ceil(vis.length / MAX_ROWS);
    runs = [];
    for (let k = 0; k < vis.length; k += size) runs.push({key: "", members: vis.slice(k, k + size)});
  }
  const cols = g.shape[1], merged = {};
  for (const mode of ["abs", "change"]) {
    const codes = codesOf(g, mode), out = new Uint8Array(runs.length * cols);
    runs.forEach((run, r) => {
      for (let c = 0; c < cols; c++) {
        let best = 255, score = -1, flags = 0;
        for (const i of run.members) {
          const v = codes[i * cols + c];
          if (v === 251) flags |= 4; else if (v === 252) flags |= 2; else if (v === 253) flags |= 1;
          else if (v < 250) {
            const sc = mode === "change" ? Math.abs(v - 124) : v;
            if (sc > score) { score = sc; best = v; }
          } else if (v === 250 && best === 255) best = 250;
        }
        out[r * cols + c] = flags & 4 ? 251 : flags & 2 ? 252 : flags & 1 ? 253 : best;
      }
    });
    merged[mode] = out;
  }
  const aggOf = new Map(), rowOfLabel = new Map();
  runs.forEach((run, r) => run.members.forEach(i => { aggOf.set(i, r); rowOfLabel.set(info.labels[i], r); }));
  const first = runs.map(run => run.members[0]);
  const labels = runs.map(run => {
    const i = run.members[0], block = info.blocks ? info.blocks[i] : "";
    return run.key ? info.groups[info.group[i]] + (block ? "." + block : "") + " (" + run.members.length + " rows)"
      : info.labels[i] + " .. (" + run.members.length + " rows)";
  });
  const condensed = Object.assign({}, g, {shape: [runs.length, cols], _codes: merged, condensed: true,
    largest: g.largest && aggOf.has(g.largest.row) ? Object.assign({}, g.largest, {row: aggOf.get(g.largest.row)})
      : null});
  return {g: condensed, info: {labels: labels, groups: info.groups, group: first.map(i => info.group[i]),
    blocks: info.blocks ? first.map(i => info.blocks[i]) : null, kinds: info.kinds ? first.map(i => info.kinds[i])
      : null, prefixes: runs.map((run, r) => run.key ? labels[r].replace(/ \(\d+ rows\)$/, "") : null)},
  vis: runs.map((_, r) => r), rowOfLabel: rowOfLabel};
}

function showGrid(original, scroll) {
  current = original;
  const box = document.getElementById("hm-map");
  box.textContent = "";
  const full = rowInfo(original), visible = visibleRows(full);
  const shown = visible.length > MAX_ROWS && original.view !== "module" ? condense(original, full, visible)
    : {g: original, info: full, vis: visible, rowOfLabel: null};
  const g = shown.g, info = shown.info, mode = state.mode, codes = codesOf(g, mode), cols = g.shape[1];
  let c0 = 0, c1 = cols;
  if (!DATA.serve && state.lo !== null && g.cols.steps) {  // a zoom of the page's own columns
    while (c0 < cols && colRange(g.cols, c0)[1] < state.lo) c0++;
    while (c1 > c0 && colRange(g.cols, c1 - 1)[0] > state.hi) c1--;
    if (c1 <= c0) { c0 = 0; c1 = cols; }
  }
  const vis = shown.vis, rows = vis.length, ncols = c1 - c0;
  if (!rows) {
    el("p", {class: "note"}, box, "No row matches the filter " + JSON.stringify(state.filter) + ".");
    return;
  }
  const rowH = Math.max(2, Math.min(16, Math.floor(960 / rows)));
  const cellW = Math.max(1, Math.min(24, Math.floor(1000 / ncols)));
  const W = ncols * cellW, H = rows * rowH;
  const wrap = el("div", {class: "view-wrap"}, box);
  const gutter = el("div", {class: "gutter"}, wrap);
  gutter.style.height = H + "px";
  drawLabels(gutter, info, vis, rowH, g.view === "module");
  if (info.kinds) {
    const strip = el("canvas", {class: "kind-strip", width: 1, height: rows}, wrap);
    strip.style.height = H + "px";
    const sctx = strip.getContext("2d"), simg = sctx.createImageData(1, rows);
    vis.forEach((i, r) => { const c = KIND_COLOURS[info.kinds[i]]; simg.data.set([c[0], c[1], c[2], 255], 4 * r); });
    sctx.putImageData(simg, 0, 0);
  }
  const right = el("div", {}, wrap);
  const stage = el("div", {class: "stage"}, right);
  stage.style.width = W + "px"; stage.style.height = H + "px";
  const canvas = el("canvas", {class: "view-canvas", width: ncols, height: rows}, stage);
  canvas.style.width = W + "px"; canvas.style.height = H + "px";
  const ctx = canvas.getContext("2d"), image = ctx.createImageData(ncols, rows);
  const palette = mode === "change" ? CHANGE_PALETTE : PALETTE;
  let nonfinite = 0;
  for (let r = 0; r < rows; r++) {
    const src = vis[r] * cols + c0;
    for (let c = 0; c < ncols; c++) {
      const code = codes[src + c], rgb = code < 250 ? palette[code] : VIEW_SPECIAL[code], o = 4 * (r * ncols + c);
      if (code >= 251 && code <= 253) nonfinite++;
      image.data[o] = rgb[0]; image.data[o + 1] = rgb[1]; image.data[o + 2] = rgb[2]; image.data[o + 3] = 255;
    }
  }
  ctx.putImageData(image, 0, 0);
  const overlay = el("svg:svg", {class: "view-overlay", width: W, height: H}, stage);
  Object.assign(canvas.dataset, {view: g.view, family: g.family, metric: g.metric, at: String(g.at), mode: mode,
    rows: rows, cols: ncols, nonfinite: nonfinite, condensed: g.condensed ? visible.length : 0});
  const groupStarts = [];
  vis.forEach((i, r) => { if (r > 0 && info.group[i] !== info.group[vis[r - 1]]) groupStarts.push(r); });
  if (rowH >= 3 && groupStarts.length < 200) {
    for (const r of groupStarts) {
      el("svg:line", {x1: 0, x2: W, y1: r * rowH, y2: r * rowH, class: "group-line"}, overlay);
    }
  }
  const infoBox = document.getElementById("hm-info");
  infoBox.textContent = VIEW_NAMES[g.view] + ": " + g.family + " " + g.metric + (g.view === "steps" ? ", rank " + g.at
    : g.view === "ranks" ? ", step " + g.at : ", " + g.at) + "; " + rows + " rows x " + ncols + " columns" +
    (g.condensed ? " (" + visible.length + " rows, a row per layer and block: the farthest cell of each; click a " +
      "row, or filter, for its rows)" : "") +
    (g.cols.width > 1 ? " (each column " + g.cols.width + " " + (g.cols.steps ? "steps" : "ranks") +
      ": the largest and smallest magnitude of the bucket)" : "") + ". ";
  if (g.largest) {
    const r = vis.indexOf(g.largest.row), c = g.largest.col - c0;
    const span = colRange(g.cols, g.largest.col);
    const text = el("span", {id: "largest-change"}, infoBox, "Largest change: " + info.labels[g.largest.row] + " at " +
      rangeText(g.cols.steps ? "steps" : "ranks", span[0], span[1]) + ", x" +
      Number(Math.pow(10, g.largest.decades).toPrecision(3)) + " vs " + reference(g) + ".");
    text.dataset.row = info.labels[g.largest.row];
    if (r >= 0 && c >= 0 && c < ncols) {
      const px = ctx.getImageData(c, r, 1, 1).data;
      Object.assign(canvas.dataset, {largestRow: info.labels[g.largest.row], largestAt: span[0],
        largestDecades: g.largest.decades.toFixed(3), largestRgb: px[0] + "," + px[1] + "," + px[2]});
      el("svg:rect", {x: c * cellW - 1.5, y: r * rowH - 1.5, width: cellW + 3, height: rowH + 3, class: "largest-cell"},
        overlay);
    }
  }
  drawAxis(right, g.cols, c0, c1, cellW);
  markEvents(g, overlay, info, vis, c0, c1, rowH, cellW, shown.rowOfLabel);
  highlight(g, overlay, info, vis, c0, c1, rowH, cellW, W, H, scroll, shown.rowOfLabel);
  stage.addEventListener("mousemove", ev => {
    const rect = stage.getBoundingClientRect(), x = ev.clientX - rect.left, y = ev.clientY - rect.top;
    const r = Math.floor(y / rowH), c = Math.floor(x / cellW);
    if (dragFrom !== null) drawDrag(overlay, dragFrom, x, H);
    if (r < 0 || r >= rows || c < 0 || c >= ncols) return hideTip();
    const span = colRange(g.cols, c0 + c), i = vis[r] * cols + c0 + c;
    showTip(ev, info.labels[vis[r]] + "\n" + rangeText(g.cols.steps ? "steps" : "ranks", span[0], span[1]) + "\n" +
      absText(g, codesOf(g, "abs")[i]) + "\n" + changeText(g, codesOf(g, "change")[i]));
  });
  stage.addEventListener("mouseleave", hideTip);
  stage.addEventListener("mousedown", ev => {
    if (!g.cols.steps) return;
    dragFrom = ev.clientX - stage.getBoundingClientRect().left; ev.preventDefault();
  });
  stage.addEventListener("mouseup", ev => {
    const rect = stage.getBoundingClientRect(), x = ev.clientX - rect.left, y = ev.clientY - rect.top;
    const from = dragFrom; dragFrom = null;
    if (from !== null && Math.abs(x - from) > 4) {
      const a = c0 + Math.max(0, Math.floor(Math.min(from, x) / cellW));
      const b = c0 + Math.min(ncols - 1, Math.floor(Math.max(from, x) / cellW));
      go({lo: colRange(g.cols, a)[0], hi: colRange(g.cols, b)[1]});
      return;
    }
    const r = Math.floor(y / rowH), c = Math.floor(x / cellW);
    if (r < 0 || r >= rows || c < 0 || c >= ncols) return;
    if (g.condensed) { if (info.prefixes[vis[r]]) go({filter: info.prefixes[vis[r]] + "."}); return; }
    showCell(g, info, vis[r], c0 + c);
  });
  drawLegend(right, g, mode);
  box.dataset.ready = "ok";
}
function drawLabels(gutter, info, vis, rowH, ranksAsRows) {
  const runs = [], LH = 12, H = vis.length * rowH;
  vis.forEach((i, r) => {
    const g = info.group[i];
    if (!runs.length || runs[runs.length - 1].group !== g) runs.push({group: g, start: r, end: r + 1});
    else runs[runs.length - 1].end = r + 1;
  });
  // Each group's label beside the middle of its rows, pushed apart where groups are smaller than a line of text;
  // too many groups for the height: every k-th group's label at its first row.
  const tops = [];
  let previous = -10;
  for (const run of runs) {
    const top = Math.max((run.start + run.end) / 2 * rowH - LH / 2, previous);
    tops.push(top); previous = top + LH;
  }
  let limit = H + 10 - LH;
  for (let i = tops.length - 1; i >= 0; i--) { tops[i] = Math.min(tops[i], limit); limit = tops[i] - LH; }
  const dense = tops.length > 0 && tops[0] < -10;
  const every = dense ? Math.ceil(runs.length * LH / (H + 20)) : 1;
  runs.forEach((run, k) => {
    if (k % every) return;
    const d = el("div", {class: "group-label", "data-group": info.groups[run.group], title: info.groups[run.group]},
      gutter, info.groups[run.group]);
    d.style.top = (dense ? run.start * rowH : tops[k]) + "px";
  });
  if (ranksAsRows || !info.blocks) return;
  if (rowH >= 10) {
    vis.forEach((i, r) => {
      const name = info.labels[i], prefix = info.groups[info.group[i]] + ".";
      const d = el("div", {class: "row-label", title: name}, gutter, name.startsWith(prefix) ? name.slice(prefix.length)
        : name);
      d.style.top = r * rowH + "px"; d.style.height = rowH + "px"; d.style.lineHeight = rowH + "px";
    });
    return;
  }
  let start = 0;
  for (let r = 1; r <= vis.length; r++) {
    const same = r < vis.length && info.group[vis[r]] === info.group[vis[start]] &&
      info.blocks[vis[r]] === info.blocks[vis[start]];
    if (same) continue;
    const height = (r - start) * rowH, block = info.blocks[vis[start]];
    if (block && height >= 9) {
      const d = el("div", {class: "block-label", title: block}, gutter, block);
      d.style.top = start * rowH + "px"; d.style.height = height + "px";
      d.style.lineHeight = Math.min(height, 12) + "px";
    }
    start = r;
  }
}
function drawAxis(parent, axis, c0, c1, cellW) {
  const W = (c1 - c0) * cellW, kind = axis.steps ? "step" : "rank";
  const svg = el("svg:svg", {class: "view-axis", width: W + 12, height: 30}, parent);
  const first = colRange(axis, c0)[0], last = colRange(axis, c1 - 1)[1];
  const values = ticks(first, Math.max(last, first + 1), Math.max(2, Math.min(10, Math.floor(W / 80))));
  for (const t of values) {
    if (Math.abs(t - Math.round(t)) > 1e-9 || t < first || t > last) continue;
    const c = colOf(axis, t);
    if (c < c0 || c >= c1) continue;
    const x = (c - c0 + (t - axisStarts(axis)[c] + 0.5) / axis.width) * cellW;
    el("svg:line", {x1: x, x2: x, y1: 0, y2: 5, class: "axis"}, svg);
    el("svg:text", {x: x, y: 17, "text-anchor": "middle", class: kind + "-tick", ["data-" + kind]: t}, svg, String(t));
  }
  el("svg:text", {x: W, y: 28, "text-anchor": "end", class: "axis-title"}, svg, kind);
}
function markEvents(g, overlay, info, vis, c0, c1, rowH, cellW, rowOfLabel) {
  const list = document.getElementById("hm-events");
  list.textContent = "";
  const rowOf = rowOfLabel || new Map();
  if (!rowOfLabel) vis.forEach((i, r) => rowOf.set(info.labels[i], r));
  const shown = [];
  for (const e of EVENTS) {
    let r = -1, c = -1;
    if (g.view === "steps") {
      if (e.rank !== g.at) continue;
      c = colOf(g.cols, e.step);
      if (e.family === g.family && rowOf.has(eventLabel(e))) r = rowOf.get(eventLabel(e));
    } else if (g.view === "ranks") {
      if (e.step !== g.at) continue;
      c = colOf(g.cols, e.rank);
      if (e.family === g.family && rowOf.has(eventLabel(e))) r = rowOf.get(eventLabel(e));
    } else {
      if (e.family !== g.family || eventLabel(e) !== g.at) continue;
      c = colOf(g.cols, e.step);
      const rank = colOf(g.rank_rows, e.rank);
      r = vis.indexOf(rank);
    }
    if (c < c0 || c >= c1) continue;
    const x = (c - c0) * cellW, W = (c1 - c0) * cellW, attrs = {"data-step": e.step, "data-rank": e.rank,
      "data-name": e.name || "", "data-detector": e.detector, "data-row": r};
    const marks = [];
    if (r >= 0 && cellW >= 4 && rowH >= 4) {
      marks.push(el("svg:rect", Object.assign({x: x - 1, y: r * rowH - 1, width: cellW + 2, height: rowH + 2,
        class: "event-cell"}, attrs), overlay));
    } else {  // small cells: a mark above the column and one right of the row, the cell's colour left as it is
      const mid = x + cellW / 2;
      marks.push(el("svg:path", Object.assign({d: `M${mid - 4},-9 L${mid + 4},-9 L${mid},-2 Z`,
        class: "event-tick"}, attrs), overlay));
      if (r >= 0) marks.push(el("svg:path", Object.assign({d: `M${W + 9},${r * rowH + rowH / 2 - 4} L${W + 9},` +
        `${r * rowH + rowH / 2 + 4} L${W + 2},${r * rowH + rowH / 2} Z`, class: "event-tick event-row-tick"}, attrs),
        overlay));
    }
    for (const mark of marks) el("svg:title", {}, mark, eventText(e));
    shown.push(e);
  }
  if (!shown.length) return;
  el("div", {class: "note"}, list, shown.length + " anomaly event(s) in this view (outlined cells, or triangles " +
    "above " +
    "their column and right of their row):");
  const ul = el("ul", {class: "view-events"}, list);
  for (const e of shown.slice(0, 50)) {
    const li = el("li", {}, ul);
    el("a", {href: eventHash(e) || "#", class: "event-link", "data-step": e.step, "data-rank": e.rank}, li,
      eventText(e));
  }
}
function highlight(g, overlay, info, vis, c0, c1, rowH, cellW, W, H, scroll, rowOfLabel) {
  let target = null;
  if (state.row && g.view !== "module") {
    const r = rowOfLabel ? (rowOfLabel.has(state.row) ? rowOfLabel.get(state.row) : -1)
      : vis.findIndex(i => info.labels[i] === state.row);
    if (r >= 0) { el("svg:rect", {x: 0, y: r * rowH - 1, width: W, height: rowH + 2, class: "row-highlight"}, overlay);
      target = r; }
  }
  if (state.at !== null && g.cols.steps) {
    const c = colOf(g.cols, state.at);
    if (c >= c0 && c < c1) el("svg:rect", {x: (c - c0) * cellW - 1, y: 0, width: cellW + 2, height: H,
      class: "col-highlight", "data-step": state.at}, overlay);
  }
  if (scroll && (state.row || state.at !== null)) {
    document.getElementById("heatmaps").scrollIntoView();
    if (target !== null) window.scrollBy(0, Math.max(0, target * rowH - 200));
  }
}
function drawDrag(overlay, from, x, H) {
  let sel = overlay.querySelector(".drag");
  if (!sel) sel = el("svg:rect", {class: "drag", y: 0, height: H}, overlay);
  sel.setAttribute("x", Math.min(from, x)); sel.setAttribute("width", Math.abs(x - from));
}
function drawLegend(parent, g, mode) {
  const legend = el("div", {class: "legend note"}, parent);
  const palette = mode === "change" ? CHANGE_PALETTE : PALETTE;
  const bar = el("canvas", {width: palette.length, height: 1, class: "colourbar"}, legend);
  bar.style.width = "250px"; bar.style.height = "12px"; bar.style.verticalAlign = "middle";
  const bctx = bar.getContext("2d"), bimg = bctx.createImageData(palette.length, 1);
  palette.forEach((rgb, i) => { bimg.data.set([rgb[0], rgb[1], rgb[2], 255], 4 * i); });
  bctx.putImageData(bimg, 0, 0);
  const range = Math.pow(10, g.change.range);
  el("span", {class: "scale"}, legend, mode === "change"
    ? " x" + fmt(1 / range) + " .. x" + fmt(range) + " vs " + reference(g) + " (log ratio; white: no change)  "
    : " |value| " + fmt(Math.pow(10, g.abs.lo)) + " .. " + fmt(Math.pow(10, g.abs.hi)) + " (log scale)  ");
  for (const [code, text] of [[250, "0"], [251, "NaN"], [252, "+Inf"], [253, "-Inf"], [255, "no value"]]) {
    if (code === 250 && mode === "change") continue;
    const item = el("span", {}, legend), sw = el("span", {class: "swatch"}, item);
    sw.style.background = "rgb(" + VIEW_SPECIAL[code].join(",") + ")"; item.appendChild(document.createTextNode(text));
  }
  if (g.view !== "module") {
    const kinds = el("div", {}, legend);
    kinds.appendChild(document.createTextNode("block: "));
    KIND_NAMES.slice(0, 5).forEach((name, k) => {
      const item = el("span", {}, kinds), sw = el("span", {class: "swatch"}, item);
      sw.style.background = "rgb(" + KIND_COLOURS[k].join(",") + ")";
      item.appendChild(document.createTextNode(name));
    });
  }
}
function showCell(g, info, row, col) {
  const box = document.getElementById("hm-cell");
  box.textContent = "";
  const span = colRange(g.cols, col), label = info.labels[row], i = row * g.shape[1] + col;
  el("div", {}, box, label + ", " + rangeText(g.cols.steps ? "steps" : "ranks", span[0], span[1]) + ": " +
    absText(g, codesOf(g, "abs")[i]) + "; " + changeText(g, codesOf(g, "change")[i]));
  const links = el("div", {class: "cell-links"}, box);
  const link = (text, changes) => {
    const a = el("a", {href: "#", class: "cell-link"}, links, text);
    a.addEventListener("click", ev => { ev.preventDefault(); go(changes); });
    links.appendChild(document.createTextNode("  "));
  };
  const rows = ROWSETS[g.family];
  if (g.view === "steps") {
    const module = rows ? moduleKey([rowVpp(rows, row), rowName(rows, row)]) : null;
    link("rank x step of this module", {view: "module", module: module, row: "", at: span[0], lo: null, hi: null});
    link("module x rank at step " + span[0], {view: "ranks", step: span[0], row: label, at: span[0], lo: null,
      hi: null});
  } else if (g.view === "ranks") {
    const module = rows ? moduleKey([rowVpp(rows, row), rowName(rows, row)]) : null;
    link("module x step of rank " + span[0], {view: "steps", rank: span[0], row: label, at: g.at, lo: null, hi: null});
    link("rank x step of this module", {view: "module", module: module, row: "", at: g.at, lo: null, hi: null});
  } else {
    const rank = g.rank_rows.ranks[row];
    link("module x step of rank " + rank, {view: "steps", rank: rank, row: g.at, at: span[0], lo: null, hi: null});
    link("module x rank at step " + span[0], {view: "ranks", step: span[0], row: g.at, at: span[0], lo: null,
      hi: null});
  }
  if (!DATA.serve) return;
  const p = {family: g.family, metric: g.metric, lo: g.cols.steps ? span[0] : g.at, hi: g.cols.steps ? span[1] : g.at};
  if (g.view === "module") { p.module = moduleKey(g.module); p.rank = g.rank_rows.ranks[row];
    p.rank_hi = Math.min(p.rank + g.rank_rows.width - 1, g.rank_rows.last); }
  else { p.module = moduleKey([rowVpp(rows, row), rowName(rows, row)]);
    p.rank = g.view === "steps" ? g.at : span[0]; p.rank_hi = g.view === "steps" ? g.at : span[1]; }
  fetchJson("api/values?" + new URLSearchParams(p).toString()).then(v => {
    const table = el("table", {class: "events values"}, box);
    const head = el("tr", {}, el("thead", {}, table));
    for (const h of v.columns) el("th", {}, head, h);
    const body = el("tbody", {}, table);
    for (const rowValues of v.rows) {
      const tr = el("tr", {class: "value-row"}, body);
      for (const x of rowValues) el("td", {}, tr, typeof x === "number" ? fmt(x) : String(x));
    }
    if (v.truncated) el("div", {class: "note"}, box, "first " + v.rows.length + " values of the cell");
  }).catch(err => el("div", {class: "note"}, box, "values: " + err.message));
}
function setupViews() {
  const $ = id => document.getElementById(id);
  readHash();
  $("hm-view").addEventListener("change", () => go({view: $("hm-view").value, lo: null, hi: null}));
  $("hm-family").addEventListener("change", () => go({family: $("hm-family").value, row: ""}));
  $("hm-metric").addEventListener("change", () => go({metric: $("hm-metric").value}));
  $("hm-rank").addEventListener("change", () => go({rank: Number($("hm-rank").value)}));
  $("hm-step").addEventListener("change", () => go({step: Number($("hm-step").value)}));
  $("hm-step-input").addEventListener("change", () => go({step: Number($("hm-step-input").value)}));
  $("hm-module").addEventListener("change", () => go({module: $("hm-module").value}));
  $("hm-mode").addEventListener("change", () => go({mode: $("hm-mode").value}));
  $("hm-filter").addEventListener("input", () => go({filter: $("hm-filter").value}));
  $("hm-unzoom").addEventListener("click", () => go({lo: null, hi: null}));
  window.addEventListener("hashchange", () => { readHash(); updateView(true); });
  updateView(Boolean(location.hash));
}

// ---- grad-probe heatmaps (one per family, metric and rank; linear scale) ----
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
  const fill = (select, values) => { const keep = select.value; select.textContent = "";
    for (const v of values) el("option", {value: v}, select, String(v));
    if (values.map(String).includes(keep)) select.value = keep; };
  const uniq = xs => Array.from(new Set(xs));
  const update = () => {
    fill(metric, uniq(list.filter(h => h.family === family.value).map(h => h.metric)));
    fill(rank, uniq(list.filter(h => h.family === family.value && h.metric === metric.value).map(h => h.rank)));
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
    s.first_step + ".." + s.last_step + ", " + s.files + " files read; written by trainmon " + s.trainmon + " on " +
    s.generated + "." + (DATA.serve ? " Served by trainmon serve: every view, at full resolution." : "");
  const curveRank = document.getElementById("curve-rank");
  for (const r of Object.keys(DATA.curves)) el("option", {value: r}, curveRank, "rank " + r);
  curveRank.addEventListener("change", drawCurves);
  if (DATA.serve) curveRank.addEventListener("change", () => loadCurves(curveRank.value));
  drawCurves();
  drawAnomalies();
  setupViews();
  if (DATA.probe.length) setupHeatmaps("probe", DATA.probe);
  else document.getElementById("probe").style.display = "none";
  for (const n of DATA.notes) el("li", {}, document.getElementById("notes"), n);
  document.body.dataset.rendered = "ok";
}
function loadCurves(rank) {
  if (DATA.curves[rank] && Object.keys(DATA.curves[rank]).length) return;
  fetchJson("api/curves?" + new URLSearchParams({rank: rank}).toString()).then(c => {
    DATA.curves[rank] = c;
    drawCurves();
  });
}
main();
