// llmc/debugger/static/app.js: the visual debugger's page. It asks the server (server.py's API)
// for what the reference trainer holds and draws it with Plotly; it computes nothing itself but
// colours. Every number shown comes from the server as the trainer's value (a tile's cell is the
// element itself where the tile says "exact", else the block's mean or worst, as the hover says).
"use strict";

const TOKEN = new URLSearchParams(location.search).get("token") || "";
const S = {                     // what the page shows now
  state: null, ops: [], selected: null, follow: true, view: "op",
  op: null, tensor: null, b: 0, h: 0, param: null,
  attLayer: 0, attHead: 0, attSeq: 0, attKind: "0",
  checkRuns: null, checkRun: 0, checkTensor: null, kernel: null, source: {},
};
const $ = (id) => document.getElementById(id);
const PLOT_CONFIG = { displaylogo: false, responsive: true };

// ---------------------------------------------------------------------------- talking to the server

async function api(path, params) {
  const q = new URLSearchParams(params || {});
  const r = await fetch(path + (q.toString() ? "?" + q : ""), { headers: { "X-Debugger-Token": TOKEN } });
  const body = await r.json();
  if (!r.ok) throw new ApiError(r.status, body.error || r.statusText);
  return body;
}

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function control(action, op) {
  const r = await fetch("/api/control", {
    method: "POST", headers: { "Content-Type": "application/json", "X-Debugger-Token": TOKEN },
    body: JSON.stringify({ action, op }),
  });
  const body = await r.json();
  if (!r.ok) { showStatusError(body.error); return; }
  S.follow = true;
  setState(body);
  let state = body;
  while (state.state === "running" || state.state === "starting") {
    state = await api("/api/state", { wait: 10 });
    setState(state);
  }
  await refresh();
}

function decode(b64) {        // base64 little-endian float32 -> Float32Array
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  return new Float32Array(bytes.buffer);
}

function fmt(v, digits = 6) {
  if (v === null || v === undefined) return "-";
  if (typeof v !== "number" || Number.isInteger(v)) return String(v);
  if (v !== 0 && (Math.abs(v) < 1e-3 || Math.abs(v) >= 1e5)) return v.toExponential(digits - 2);
  return v.toFixed(digits);
}

function esc(s) {
  return String(s).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]));
}

// ---------------------------------------------------------------------------- status and op list

function setState(state) {
  S.state = state;
  const st = $("status");
  st.className = state.state;
  const m = state.model;
  if (m) $("model-info").textContent = `${m.family} L=${m.L} NH=${m.NH} C=${m.C} V=${m.V} | B=${m.B} T=${m.T} | ` +
    `${m.parameters.toLocaleString()} parameters`;
  let text = "";
  if (state.state === "paused") {
    const op = S.ops[state.op];
    text = `step ${state.step} · micro-batch ${state.micro + 1} · ${state.phase} · op ${state.op + 1}/${state.num_ops}` +
      (state.layer !== null ? ` · layer ${state.layer}` : "") + ` · ${esc(state.op_label)}`;
    if (op) text += ` <a href="#" data-src="${esc(basename(op.call_file))}" data-line="${op.call_line}">` +
      `${esc(basename(op.call_file))}:${op.call_line}</a>`;
  } else if (state.state === "failed") {
    text = `the trainer stopped: ${esc(state.error)}`;
  } else {
    text = state.state === "running" ? "running..." : state.state;
  }
  if (state.loss !== null) text += ` · <span class="loss" id="loss-value">loss ${state.loss.toFixed(6)}</span>`;
  const sl = state.step_line;
  if (sl && state.phase === "update") text += ` · trainer's step line: <span id="step-line">loss ${fmt(sl.loss)} | ` +
    `norm ${sl.norm === null ? "-" : sl.norm.toFixed(4)} | lr ${sl.lr === null ? "-" : sl.lr.toExponential(2)}</span>`;
  st.innerHTML = text;
  const busy = state.state !== "paused";
  for (const id of ["btn-step", "btn-run-to", "btn-finish", "btn-next-step"]) $(id).disabled = busy;
  document.body.dataset.state = state.state;
}

function showStatusError(message) {
  $("status").innerHTML += ` · <span class="error">${esc(message)}</span>`;
}

function basename(path) { return path.split("/").pop(); }

function renderOpList(ops) {
  S.ops = ops;
  const ol = $("oplist");
  ol.innerHTML = "";
  let phase = null;
  for (const op of ops) {
    if (op.phase !== phase) {
      phase = op.phase;
      const h = document.createElement("li");
      h.className = "phase";
      h.textContent = { forward: "forward", backward: "backward (reverse order)", update: "gradient norm and AdamW" }[phase];
      ol.appendChild(h);
    }
    const li = document.createElement("li");
    li.dataset.op = op.index;
    li.title = op.statement;
    li.textContent = `${String(op.index + 1).padStart(3)} ${op.layer !== null ? "L" + op.layer + " " : ""}${op.label}`;
    li.addEventListener("click", () => { S.follow = false; redraw(() => selectOp(op.index)); });
    ol.appendChild(li);
  }
  markOps();
}

function markOps() {
  const cur = S.state && S.state.state === "paused" ? S.state.op : null;
  for (const li of document.querySelectorAll("#oplist li[data-op]")) {
    const i = Number(li.dataset.op);
    li.classList.toggle("pending", !S.ops[i].ran);
    li.classList.toggle("current", i === cur);
    li.classList.toggle("selected", i === S.selected);
  }
}

async function refresh() {
  const [state, ops] = await Promise.all([api("/api/state"), api("/api/ops")]);
  S.ops = ops.ops;                      // first: the status line links to the current op's call
  setState(state);
  renderOpList(ops.ops);
  if (S.follow && state.op !== null) S.selected = state.op;
  markOps();
  const cur = document.querySelector("#oplist li.current");
  if (cur && S.follow) cur.scrollIntoView({ block: "nearest" });
  await drawView();
  document.body.dataset.ready = String(state.version);
}

async function selectOp(i) {
  S.selected = i;
  markOps();
  if (S.view !== "op") showView("op");
  await drawView();
}

// ---------------------------------------------------------------------------- heatmaps

// A tile from the server as a Plotly heatmap: rows and columns at the tile's element indices,
// the hover giving the element (exact) or the block's extent and its mean or worst element.
function heatmap(div, tile, opts) {
  const [nr, nc] = tile.shape;
  const data = decode(tile.data);
  const [sr, sc] = tile.step;
  const z = [], x = [], y = [];
  for (let j = 0; j < nc; j++) x.push(tile.c0 + j * sc);
  for (let i = 0; i < nr; i++) { y.push(tile.r0 + i * sr); z.push(Array.from(data.subarray(i * nc, (i + 1) * nc))); }
  const [ry, rx] = opts.axes || ["row", "col"];
  const exact = tile.reduce === "exact";
  const what = opts.valueName || "value";
  const trace = {
    type: "heatmap", z, x, y, colorscale: opts.colorscale || "RdBu", reversescale: !opts.colorscale,
    zmid: opts.zmid, hoverongaps: false,
    hovertemplate: exact
      ? `${ry} %{y}, ${rx} %{x}<br>${what} %{z:.9g}<extra></extra>`
      : `${ry} %{y}..+${sr - 1}, ${rx} %{x}..+${sc - 1}<br>block ${tile.reduce} of ${what} %{z:.6g}<extra></extra>`,
  };
  if (opts.yticks) { trace.y = y; }
  const layout = {
    margin: { l: opts.left || 50, r: 10, t: 28, b: 40 }, title: { text: opts.title || "", font: { size: 13 } },
    yaxis: { autorange: "reversed", title: ry, tickvals: opts.yticks && opts.yticks.vals, ticktext: opts.yticks && opts.yticks.text },
    xaxis: { title: rx, tickvals: opts.xticks && opts.xticks.vals, ticktext: opts.xticks && opts.xticks.text },
  };
  const drawn = Plotly.react(div, [trace], layout, PLOT_CONFIG);   // a promise: the plot is drawn
  div.dataset.reduce = tile.reduce;
  if (!div._zoomHooked && opts.onZoom) {
    div._zoomHooked = true;
    div.on("plotly_relayout", (ev) => {
      if (ev["xaxis.range[0]"] !== undefined || ev["xaxis.autorange"]) div._onZoom(ev);
    });
  }
  div._onZoom = opts.onZoom;
  return drawn;
}

function zoomRange(ev, tile) {   // the element region a Plotly zoom asks for
  if (ev["xaxis.autorange"]) return {};
  const c0 = Math.max(0, Math.floor(ev["xaxis.range[0]"])), c1 = Math.ceil(ev["xaxis.range[1]"]) + 1;
  const ys = [ev["yaxis.range[0]"], ev["yaxis.range[1]"]].filter((v) => v !== undefined);
  const r = ys.length === 2 ? { r0: Math.max(0, Math.floor(Math.min(...ys))), r1: Math.ceil(Math.max(...ys)) + 1 } : {};
  return { c0, c1, ...r };
}

function histogram(div, h, title) {
  const centers = [], widths = [];
  for (let i = 0; i + 1 < h.edges.length; i++) { centers.push((h.edges[i] + h.edges[i + 1]) / 2); widths.push(h.edges[i + 1] - h.edges[i]); }
  const sub = h.sampled_every > 1 ? ` (every ${h.sampled_every}th element)` : "";
  Plotly.react(div, [{ type: "bar", x: centers, y: h.counts, width: widths, marker: { color: "#36c" } }],
    { margin: { l: 40, r: 10, t: 24, b: 30 }, title: { text: (title || "histogram") + sub, font: { size: 12 } }, bargap: 0 },
    PLOT_CONFIG);
}

function statsTable(table, st, extra) {
  const rows = [["mean", st.mean], ["std", st.std], ["min", st.min], ["max", st.max], ["elements", st.n]];
  if (st.nonfinite) rows.push(["non-finite", st.nonfinite]);
  table.innerHTML = rows.map(([k, v]) => `<tr><td>${k}</td><td>${typeof v === "number" && k !== "elements" ? fmt(v, 8) : v}</td></tr>`).join("") +
    `<tr><td colspan="2" class="note">${extra || "derived: over the matrix shown"}</td></tr>`;
}

// ---------------------------------------------------------------------------- the views

let DRAWN = 0;

// Run a drawing function; then body[data-drawn] counts one more finished drawing (what a test or
// the benchmark waits for after a click).
async function redraw(fn) {
  try { await fn(); } finally { document.body.dataset.drawn = String(++DRAWN); }
}

function showView(name) {
  S.view = name;
  for (const b of document.querySelectorAll("#tabs button")) b.classList.toggle("active", b.dataset.view === name);
  for (const v of document.querySelectorAll(".view")) v.classList.toggle("hidden", v.id !== "view-" + name);
}

async function drawView() {
  try {
    if (S.view === "op") await drawOp();
    else if (S.view === "attention") await drawAttention();
    else if (S.view === "loss") await drawLoss();
    else if (S.view === "adamw") await drawAdamW();
    else if (S.view === "check") await drawCheck();
    else if (S.view === "kernel") await drawKernel();
  } catch (e) {
    if (!(e instanceof ApiError)) throw e;
  }
}

function fillSelect(sel, values, labels, current) {
  const want = values.map(String).join("|") + "#" + (labels || []).join("|");
  if (sel.dataset.values !== want) {
    sel.innerHTML = values.map((v, i) => `<option value="${esc(v)}">${esc(labels ? labels[i] : v)}</option>`).join("");
    sel.dataset.values = want;
  }
  if (current !== undefined && values.map(String).includes(String(current))) sel.value = String(current);
}

function range(n) { return Array.from({ length: n }, (_, i) => i); }

async function drawOp() {
  const i = S.selected;
  const title = $("op-title");
  if (i === null || i === undefined) { title.textContent = "no op yet"; return; }
  const op = S.ops[i];
  const src = (f, l) => `<a href="#" data-src="${esc(basename(f))}" data-line="${l}">${esc(basename(f))}:${l}</a>`;
  title.innerHTML = `<b>op ${i + 1}: ${esc(op.label)}</b> (${op.phase}${op.layer !== null ? ", layer " + op.layer : ""})<br>` +
    `<code>${esc(op.statement)}</code> in ${esc(op.caller)}, ${src(op.call_file, op.call_line)}; ` +
    `<code>def ${esc(op.function)}</code> at ${src(op.def_file, op.def_line)}`;
  let detail;
  try {
    detail = await api("/api/op", { op: i });
  } catch (e) {
    if (!(e instanceof ApiError)) throw e;
    $("tensor-where").textContent = e.message;
    for (const id of ["heatmap", "hist"]) Plotly.purge($(id));
    $("stats").innerHTML = ""; $("params").innerHTML = ""; $("scalars").innerHTML = "";
    $("param-detail").classList.add("hidden");
    S.op = null;
    return;
  }
  S.op = detail;
  const usable = detail.tensors.filter((t) => !t.evicted);
  if (!usable.some((t) => t.key === S.tensor)) {
    const first = usable.find((t) => t.role === "returned") || usable[0];
    S.tensor = first ? first.key : null;
  }
  fillSelect($("tensor-select"), detail.tensors.map((t) => t.key),
    detail.tensors.map((t) => `${t.role}: ${t.name}${t.shape ? " (" + t.shape.join(",") + ")" : ""}${t.evicted ? " - let go" : ""}`),
    S.tensor);
  const B = S.state.model.B;
  fillSelect($("seq-select"), range(B), null, S.b);
  const t = detail.tensors.find((x) => x.key === S.tensor);
  $("head-label").classList.toggle("hidden", !t || t.heads <= 1);
  if (t && t.heads > 1) fillSelect($("head-select"), range(t.heads), null, S.h);
  if (t) {
    $("tensor-where").textContent = `${t.name}: ${t.dtype} (${t.shape.join(", ")})` +
      (t.where ? ` = ${t.where}` : " (the op's own array)") + (detail.current ? "" : " (kept from when the op ran)");
  }
  await Promise.all([t ? drawTensor() : Promise.resolve(), drawParams(detail)]);
  $("scalars").innerHTML = Object.entries(detail.scalars).map(([k, v]) => `<tr><td>${esc(k)}</td><td>${fmt(v, 8)}</td></tr>`).join("");
}

async function drawTensor(zoom) {
  const i = S.selected;
  const params = { op: i, tensor: S.tensor, b: S.b, h: S.h, ...(zoom || {}) };
  const [tile, summary] = await Promise.all([api("/api/tile", params),
    zoom ? Promise.resolve(null) : api("/api/summary", { op: i, tensor: S.tensor, b: S.b, h: S.h })]);
  const name = (S.op.tensors.find((x) => x.key === S.tensor) || {}).name || S.tensor;
  heatmap($("heatmap"), tile, {
    axes: tile.axes, valueName: name, zmid: 0,
    title: `${name}, sequence ${S.b}: ${tile.rows} x ${tile.cols}` + (tile.reduce === "exact" ? "" : ` (blocks of ${tile.step.join("x")}: mean)`),
    onZoom: (ev) => drawTensor(zoomRange(ev, tile)),
  });
  if (summary) {
    statsTable($("stats"), summary.stats);
    histogram($("hist"), summary.histogram, `histogram of ${name}`);
  }
}

async function drawParams(detail) {
  const table = $("params");
  if (!detail.params.length) {
    table.innerHTML = `<tr><td>this op has no parameters</td></tr>`;
    $("param-detail").classList.add("hidden");
    return;
  }
  table.innerHTML = "<tr><th>parameter</th><th>shape</th><th>mean</th><th>std</th><th>gradient std</th>" +
    "<th>update std</th><th>||update|| / ||parameter|| (derived)</th></tr>";
  if (!S.param || !detail.params.some((p) => p.name === S.param.name && p.layer === S.param.layer)) S.param = detail.params[0];
  for (const p of detail.params) {
    const tr = document.createElement("tr");
    tr.className = "clickable";
    tr.dataset.param = p.name;
    const label = `model.P["${p.name}"]` + (p.layer !== null ? `[${p.layer}]` : "");
    tr.innerHTML = `<td>${esc(label)}</td><td colspan="6">...</td>`;
    tr.addEventListener("click", () => { S.param = p; redraw(() => drawParamDetail()); });
    table.appendChild(tr);
    api("/api/param", { name: p.name, layer: p.layer === null ? "-" : p.layer }).then((d) => {
      tr.innerHTML = `<td>${esc(label)}</td><td>(${d.shape.join(",")})</td><td>${fmt(d.P.mean)}</td><td>${fmt(d.P.std)}</td>` +
        `<td>${fmt(d.G.std)}</td><td>${d.update ? fmt(d.update.std) : "no update yet"}</td>` +
        `<td class="ratio">${d.ratio !== undefined && d.ratio !== null ? d.ratio.toExponential(3) + " (step " + d.update_step + ")" : "-"}</td>`;
    }).catch(() => {});
  }
  $("param-detail").classList.remove("hidden");
  await drawParamDetail();
}

async function drawParamDetail(zoom) {
  const p = S.param;
  if (!p) return;
  for (const tr of document.querySelectorAll("#params tr[data-param]")) tr.classList.toggle("chosen", tr.dataset.param === p.name);
  const which = $("param-which").value;
  const key = `${which}:${p.name}:${p.layer === null ? "-" : p.layer}`;
  try {
    const tile = await api("/api/tile", { op: S.selected, tensor: key, ...(zoom || {}) });
    const label = { P: "model.P", G: "model.G", update: "AdamW update" }[which] + `["${p.name}"]` + (p.layer !== null ? `[${p.layer}]` : "");
    await heatmap($("param-heatmap"), tile, { axes: tile.axes, valueName: label, zmid: 0,
      title: `${label}: ${tile.rows} x ${tile.cols}` + (tile.reduce === "exact" ? "" : ` (blocks of ${tile.step.join("x")}: mean)`),
      onZoom: (ev) => drawParamDetail(zoomRange(ev, tile)) });
  } catch (e) {
    if (!(e instanceof ApiError)) throw e;
    Plotly.react($("param-heatmap"), [], { title: { text: e.message, font: { size: 13 } } }, PLOT_CONFIG);
  }
}

let TOKENS = null;

async function tokens(b) {
  if (!TOKENS || TOKENS.b !== b || TOKENS.version !== S.state.version) {
    TOKENS = await api("/api/tokens", { b });
    TOKENS.version = S.state.version;
  }
  return TOKENS;
}

async function drawAttention(zoom) {
  const m = S.state.model;
  if (!m) return;
  fillSelect($("att-layer"), range(m.L), null, S.attLayer);
  fillSelect($("att-head"), range(m.NH), null, S.attHead);
  fillSelect($("att-seq"), range(m.B), null, S.attSeq);
  $("att-kind").value = S.attKind;
  const div = $("att-heatmap");
  let tile;
  try {
    tile = await api("/api/attention", { layer: S.attLayer, head: S.attHead, b: S.attSeq, grad: S.attKind, ...(zoom || {}) });
  } catch (e) {
    if (!(e instanceof ApiError)) throw e;
    $("att-info").textContent = e.message;
    Plotly.purge(div);
    return;
  }
  const tok = await tokens(S.attSeq);
  const label = (i) => `${i} ${JSON.stringify(tok.tokens[i])}`;
  const ticks = (a0, a1, step) => {
    const vals = [];
    const every = Math.max(step, Math.ceil((a1 - a0) / 64));
    for (let i = a0; i < a1; i += every) vals.push(i);
    return { vals, text: vals.map(label) };
  };
  const grad = S.attKind === "1";
  $("att-info").textContent = `layer ${S.attLayer}, head ${S.attHead}, sequence ${S.attSeq}: ${grad ? "d loss / d att" : "att, the softmax probabilities"} ` +
    `(${tile.rows} x ${tile.cols}), from ${tile.source}. Row t: what token t attends to (keys after t are masked to 0).`;
  heatmap(div, tile, {
    axes: ["query t", "key t"], valueName: grad ? "datt" : "att", left: 140,
    colorscale: grad ? undefined : "Viridis", zmid: grad ? 0 : undefined,
    yticks: ticks(tile.r0, tile.r1, tile.step[0]), xticks: ticks(tile.c0, tile.c1, tile.step[1]),
    title: grad ? "gradient of the attention probabilities" : "attention probabilities",
    onZoom: (ev) => drawAttention(zoomRange(ev, tile)),
  });
}

function lossColor(v, max) {  // white (0) to red (max)
  const a = max > 0 ? Math.min(1, v / max) : 0;
  const g = Math.round(255 * (1 - a)), bl = Math.round(255 * (1 - a * 0.8));
  return `rgb(255,${g},${bl})`;
}

async function drawLoss() {
  const m = S.state.model;
  if (!m) return;
  fillSelect($("loss-seq"), range(m.B), null, S.b);
  const tok = await api("/api/tokens", { b: S.b });
  const text = $("loss-text");
  text.innerHTML = "";
  if (tok.losses === null) {
    $("loss-info").textContent = "no forward pass has computed the losses yet";
  } else {
    const max = Math.max(...tok.losses);
    const mean = tok.losses.reduce((a, b) => a + b, 0) / tok.losses.length;
    $("loss-info").textContent = `step ${tok.loss_step}, sequence ${S.b}: each token coloured by the loss of predicting the ` +
      `next one (losses[b, t] = -log probs[b, t, target]); darker is harder. Mean over this sequence ${mean.toFixed(4)} (derived).`;
    tok.tokens.forEach((t, i) => {
      const span = document.createElement("span");
      span.textContent = t;
      span.dataset.t = i;
      span.style.background = lossColor(tok.losses[i], max);
      span.title = `t=${i} ${JSON.stringify(t)} -> target ${JSON.stringify(tok.targets[i])}: loss ${tok.losses[i].toFixed(6)}`;
      text.appendChild(span);
    });
    Plotly.react($("loss-chart"), [{ type: "bar", x: range(tok.losses.length), y: tok.losses,
      text: tok.targets.map((t) => JSON.stringify(t)), hovertemplate: "t=%{x} target %{text}<br>loss %{y:.6f}<extra></extra>" }],
    { margin: { l: 50, r: 10, t: 24, b: 40 }, title: { text: "loss per position", font: { size: 13 } },
      xaxis: { title: "t" }, yaxis: { title: "loss" } }, PLOT_CONFIG);
  }
  const h = S.state.history;
  Plotly.react($("loss-history"), [{ type: "scatter", mode: "lines+markers", x: h.map((r) => r[0] + 1), y: h.map((r) => r[1]) }],
    { margin: { l: 50, r: 10, t: 10, b: 40 }, xaxis: { title: "step" }, yaxis: { title: "loss" } }, PLOT_CONFIG);
}

async function drawAdamW() {
  let d;
  try {
    d = await api("/api/adamw");
  } catch (e) {
    if (!(e instanceof ApiError)) throw e;
    $("adamw-info").textContent = e.message;
    $("adamw-table").innerHTML = "";
    Plotly.purge($("adamw-chart"));
    return;
  }
  $("adamw-info").textContent = `The update of step ${d.step}: for each parameter tensor (per layer), ||update|| / ||parameter|| ` +
    `(derived from model.params after and before gpt2_update). About 1e-3 is the usual healthy rate.`;
  const names = d.rows.map((r) => r.name + (r.layer !== null ? `[${r.layer}]` : ""));
  Plotly.react($("adamw-chart"), [{ type: "bar", x: names, y: d.rows.map((r) => r.ratio),
    hovertemplate: "%{x}<br>ratio %{y:.4e}<extra></extra>" }],
  { margin: { l: 60, r: 10, t: 10, b: 90 }, yaxis: { type: "log", title: "||update|| / ||parameter||" } }, PLOT_CONFIG);
  $("adamw-table").innerHTML = "<tr><th>tensor</th><th>||parameter||</th><th>||update||</th><th>ratio</th></tr>" +
    d.rows.map((r, i) => `<tr><td>${esc(names[i])}</td><td>${fmt(r.norm_p)}</td><td>${fmt(r.norm_update)}</td>` +
      `<td>${r.ratio === null ? "-" : r.ratio.toExponential(4)}</td></tr>`).join("");
}

async function drawCheck(zoom) {
  if (!S.checkRuns) S.checkRuns = (await api("/api/check")).runs;
  const runs = S.checkRuns;
  if (!runs.length) {
    $("check-info").textContent = "No --check run loaded. Save one with `python gpt2_cuda.py --check-save check.npz` " +
      "(add --device cpu for the emulated device, --precision bf16 for bf16), then start the debugger with --check-run check.npz.";
    return;
  }
  fillSelect($("check-run"), range(runs.length), runs.map((r) => r.path), S.checkRun);
  const run = runs[S.checkRun];
  const m = run.meta;
  $("check-info").textContent = `${run.path}: ${m.model} B=${m.B} T=${m.T} ${m.precision} on ${m.device}, ${m.attention} attention, ` +
    `against the reference in ${m.reference_dtype}; tolerances '${m.group}' (llmc/check.py): an element passes when ` +
    `|gpu - ref| <= atol' + rtol |ref|, atol' = atol x max|ref|. ${m.ok ? "All tensors passed." : "Some tensors failed."}`;
  const table = $("check-table");
  if (table.dataset.run !== String(S.checkRun)) {
    table.dataset.run = String(S.checkRun);
    table.innerHTML = "<tr><th>tensor</th><th>kind</th><th>shape</th><th>atol'</th><th>rtol</th><th>max |gpu - ref|</th>" +
      "<th>/ max|ref|</th><th>worst error / tolerance</th><th>outside</th></tr>";
    for (const r of run.rows) {
      const tr = document.createElement("tr");
      tr.className = "clickable";
      tr.dataset.tensor = r.label;
      tr.innerHTML = `<td>${esc(r.label)}</td><td>${r.kind}</td><td>(${r.shape.join(",")})</td><td>${r.atol.toExponential(2)}</td>` +
        `<td>${r.rtol.toExponential(1)}</td><td>${r.maxdiff.toExponential(3)}</td><td>${r.rel.toExponential(3)}</td>` +
        `<td class="${r.ok ? "" : "bad"}">${r.max_ratio.toFixed(4)}</td><td class="${r.ok ? "" : "bad"}">${r.bad}</td>`;
      tr.addEventListener("click", () => { S.checkTensor = r.label; redraw(() => drawCheck()); });
      table.appendChild(tr);
    }
  }
  if (!S.checkTensor || !run.rows.some((r) => r.label === S.checkTensor)) S.checkTensor = run.rows[0].label;
  const row = run.rows.find((r) => r.label === S.checkTensor);
  for (const tr of table.querySelectorAll("tr[data-tensor]")) tr.classList.toggle("chosen", tr.dataset.tensor === row.label);
  fillSelect($("check-layer"), range(row.layered ? row.shape[0] : 1), null, S.checkLayer || 0);
  fillSelect($("check-seq"), range(m.B), null, S.checkSeq || 0);
  const params = { run: S.checkRun, tensor: row.label, layer: $("check-layer").value, b: $("check-seq").value,
    h: S.checkHead || 0, ...(zoom || {}) };
  const [err, ratio] = await Promise.all([api("/api/check/tile", { ...params, what: "error" }),
    api("/api/check/tile", { ...params, what: "ratio" })]);
  fillSelect($("check-head"), range(err.heads), null, S.checkHead || 0);
  heatmap($("check-error"), err, { axes: err.axes, valueName: "|gpu - ref|", colorscale: "Reds",
    title: `${row.label}: |gpu - ref| (max ${err.slice_max.toExponential(2)})`, onZoom: (ev) => drawCheck(zoomRange(ev, err)) });
  heatmap($("check-ratio"), ratio, { axes: ratio.axes, valueName: "error / tolerance", colorscale: "Reds",
    title: `error / (atol' + rtol |ref|): <= 1 passes (max ${ratio.slice_max.toFixed(3)})` });
}

async function drawKernel() {
  if (!S.kernel) S.kernel = await api("/api/kernel");
  const k = S.kernel;
  if (!k.loaded) {
    $("kernel-message").textContent = k.message;
    $("kernel-body").classList.add("hidden");
    return;
  }
  $("kernel-body").classList.remove("hidden");
  $("kernel-message").textContent = `${k.kernel} (${k.source}): grid (${k.grid.join(",")}), block (${k.block.join(",")}), ` +
    `${k.accesses.length} warp requests. Each element coloured by the thread (warp x ${k.warp_size || 32} + lane) that first ` +
    `touched it in the chosen block; hover for block, warp, lane and source line.`;
  const blocks = [...new Set(k.accesses.map((a) => a.block.join(",")))];
  fillSelect($("kernel-buffer"), k.buffers.map((b) => b.name), k.buffers.map((b) => `${b.name} (${b.space})`), $("kernel-buffer").value);
  fillSelect($("kernel-block"), blocks, blocks.map((b) => `(${b})`), $("kernel-block").value);
  const buf = k.buffers.find((b) => b.name === $("kernel-buffer").value) || k.buffers[0];
  const block = $("kernel-block").value, which = $("kernel-op").value;
  const width = buf.row || Math.min(buf.elements, 64);
  const rows = Math.ceil(buf.elements / width);
  const ws = k.warp_size || 32;
  const z = range(rows).map(() => new Array(width).fill(null));
  const text = range(rows).map(() => new Array(width).fill(""));
  for (const a of k.accesses) {
    if (a.buffer !== buf.name || a.block.join(",") !== block || (which !== "all" && a.op !== which)) continue;
    a.elements.forEach((e, j) => {
      const r = Math.floor(e / width), c = e % width;
      if (z[r][c] === null) {
        z[r][c] = a.warp * ws + a.lanes[j];
        text[r][c] = `element ${e}: ${a.op} by block (${a.block}) warp ${a.warp} lane ${a.lanes[j]}, line ${a.line}`;
      }
    });
  }
  Plotly.react($("kernel-heatmap"), [{ type: "heatmap", z, text, colorscale: "Viridis", hoverongaps: false,
    hovertemplate: "%{text}<extra></extra>" }],
  { margin: { l: 50, r: 10, t: 28, b: 40 }, title: { text: `${buf.name}: ${buf.elements} elements, ${width} per row`, font: { size: 13 } },
    yaxis: { autorange: "reversed", title: `element / ${width}` }, xaxis: { title: `element % ${width}` } }, PLOT_CONFIG);
  $("kernel-warps").innerHTML = "<tr><th>block</th><th>warp</th><th>requests</th><th>sectors / request</th><th>bank conflicts</th></tr>" +
    (k.warps || []).map((w) => `<tr><td>(${w.block})</td><td>${w.warp}</td><td>${w.requests ?? "-"}</td>` +
      `<td>${w.sectors_per_request ?? "-"}</td><td>${w.bank_conflicts ?? "-"}</td></tr>`).join("");
}

async function showSource(file, line) {
  showView("source");
  if (!S.source[file]) {
    const r = await fetch(`/source/${encodeURIComponent(file)}`, { headers: { "X-Debugger-Token": TOKEN } });
    if (!r.ok) { $("source-name").textContent = `cannot show ${file}`; return; }
    S.source[file] = (await r.text()).split("\n");
  }
  $("source-name").textContent = `${file}, line ${line} (read-only: the file this run imported)`;
  const pre = $("source-text");
  pre.innerHTML = S.source[file].map((l, i) =>
    `<span class="line${i + 1 === line ? " hl" : ""}" id="L${i + 1}"><span class="ln">${i + 1}</span>${esc(l)}</span>`).join("");
  const target = document.getElementById("L" + line);
  if (target) target.scrollIntoView({ block: "center" });
}

// ---------------------------------------------------------------------------- wiring

function wire() {
  $("btn-step").addEventListener("click", () => control("op"));
  $("btn-run-to").addEventListener("click", () => S.selected !== null && control("to", S.selected));
  $("btn-finish").addEventListener("click", () => control("finish"));
  $("btn-next-step").addEventListener("click", () => control("next_step"));
  document.addEventListener("keydown", (e) => {
    if (e.target.tagName === "SELECT" || e.target.tagName === "INPUT" || $("btn-step").disabled) return;
    const act = { n: "btn-step", r: "btn-run-to", f: "btn-finish", s: "btn-next-step" }[e.key];
    if (act) $(act).click();
  });
  for (const b of document.querySelectorAll("#tabs button")) {
    b.addEventListener("click", () => { showView(b.dataset.view); redraw(() => b.dataset.view !== "source" && drawView()); });
  }
  document.addEventListener("click", (e) => {
    const a = e.target.closest("a[data-src]");
    if (a) { e.preventDefault(); redraw(() => showSource(a.dataset.src, Number(a.dataset.line))); }
  });
  $("tensor-select").addEventListener("change", (e) => { S.tensor = e.target.value; S.h = 0; redraw(drawOp); });
  $("seq-select").addEventListener("change", (e) => { S.b = Number(e.target.value); redraw(() => drawTensor()); });
  $("head-select").addEventListener("change", (e) => { S.h = Number(e.target.value); redraw(() => drawTensor()); });
  $("param-which").addEventListener("change", () => redraw(() => drawParamDetail()));
  $("att-layer").addEventListener("change", (e) => { S.attLayer = Number(e.target.value); redraw(() => drawAttention()); });
  $("att-head").addEventListener("change", (e) => { S.attHead = Number(e.target.value); redraw(() => drawAttention()); });
  $("att-seq").addEventListener("change", (e) => { S.attSeq = Number(e.target.value); redraw(() => drawAttention()); });
  $("att-kind").addEventListener("change", (e) => { S.attKind = e.target.value; redraw(() => drawAttention()); });
  $("loss-seq").addEventListener("change", (e) => { S.b = Number(e.target.value); redraw(drawLoss); });
  $("check-run").addEventListener("change", (e) => { S.checkRun = Number(e.target.value); S.checkTensor = null; redraw(() => drawCheck()); });
  $("check-layer").addEventListener("change", (e) => { S.checkLayer = Number(e.target.value); redraw(() => drawCheck()); });
  $("check-seq").addEventListener("change", (e) => { S.checkSeq = Number(e.target.value); redraw(() => drawCheck()); });
  $("check-head").addEventListener("change", (e) => { S.checkHead = Number(e.target.value); redraw(() => drawCheck()); });
  for (const id of ["kernel-buffer", "kernel-block", "kernel-op"]) $(id).addEventListener("change", () => redraw(drawKernel));
}

async function start() {
  wire();
  let state = await api("/api/state");
  while (state.state === "starting" || state.state === "running") state = await api("/api/state", { wait: 10 });
  await refresh();
}

start();
