// Tidal's live dashboard: reads /dashboard/events (server-sent events) and draws on canvases.
// No dependencies. Events: `hello` {config, history} once, `state` (engine snapshot + metric totals, and
// `steps`: the batch of each step since the previous state) a few times a second, `point` (one
// time-series point) once a second.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "tidal-dashboard-api-key";
const MAX_STEPS = 200;  // step bars kept: one per engine step, the newest on the right
let config = null;
let points = [];
let steps = [];  // [step number, time, prefill tokens, decode tokens, requests], oldest first
let lastState = null;
let source = null;

// -- access ---------------------------------------------------------------------------------------
async function start() {
  const auth = await (await fetch("/dashboard/auth")).json();
  if (auth.api_key_required && !sessionStorage.getItem(KEY_STORE)) return askForKey("");
  await connect();
}

function askForKey(message) {
  $("main").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message;
  $("api-key").focus();
  setStatus("API key needed", "");
}

$("login").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem(KEY_STORE, $("api-key").value);
  connect();
});

async function connect() {
  const key = sessionStorage.getItem(KEY_STORE);
  const r = await fetch("/dashboard/token", key ? { headers: { Authorization: "Bearer " + key } } : {});
  if (r.status === 401) {
    sessionStorage.removeItem(KEY_STORE);
    return askForKey("That key was refused.");
  }
  const { token } = await r.json();
  $("login").hidden = true;
  $("main").hidden = false;
  if (source) source.close();
  source = new EventSource("/dashboard/events" + (token ? "?token=" + encodeURIComponent(token) : ""));
  source.addEventListener("hello", (e) => onHello(JSON.parse(e.data)));
  source.addEventListener("state", (e) => onState(JSON.parse(e.data)));
  source.addEventListener("point", (e) => onPoint(JSON.parse(e.data)));
  source.addEventListener("engine_error", (e) => setStatus("engine failed: " + JSON.parse(e.data).message, "down"));
  source.onerror = () => {
    setStatus("reconnecting", "down");
    if (source.readyState === EventSource.CLOSED) setTimeout(connect, 2000);  // e.g. a restarted server
  };
}

function setStatus(text, cls) {
  $("status").textContent = text;
  $("status").className = "status " + cls;
}

// -- events ---------------------------------------------------------------------------------------
function onHello(hello) {
  config = hello.config;
  points = hello.history;
  steps = [];  // a new stream: its first state sends the steps the server keeps
  $("model").textContent = config.model;
  $("config").textContent = `${config.dtype} · max_model_len ${config.max_model_len} · ${config.num_blocks} KV ` +
    `blocks of ${config.block_size} tokens · max_num_seqs ${config.max_num_seqs} · max_num_batched_tokens ` +
    `${config.max_num_batched_tokens}` + (config.prefix_caching ? " · prefix caching" : "") +
    (config.speculative ? " · speculative decoding" : "");
  $("tile-spec").hidden = $("panel-spec").hidden = !config.speculative;
  setStatus("live", "live");
  drawCharts();
}

function onState(s) {
  lastState = s;
  setStatus("live", "live");
  const t = s.totals || {};
  $("stat-running").textContent = s.num_running;
  $("stat-waiting").textContent = s.num_waiting;
  $("stat-kv-usage").textContent = pct(s.kv.usage);
  $("stat-prompt-tokens").textContent = int(t.prompt_tokens);
  $("stat-generation-tokens").textContent = int(t.generation_tokens);
  $("stat-requests-finished").textContent = int(t.requests_finished);
  $("stat-preemptions").textContent = int(t.preemptions);
  $("stat-prefix-hit-rate").textContent = t.prefix_queries ? pct(t.prefix_hits / t.prefix_queries) : "–";
  $("stat-spec-acceptance").textContent = t.spec_draft_tokens ? pct(t.spec_accepted_tokens / t.spec_draft_tokens) : "–";
  for (const step of s.steps || []) if (!steps.length || step[0] > steps[steps.length - 1][0]) steps.push(step);
  if (steps.length > MAX_STEPS) steps.splice(0, steps.length - MAX_STEPS);
  drawKvMap(s);
  drawStateSlots(s);
  drawSteps(s.step);
  drawRequests(s);
}

function onPoint(p) {
  points.push(p);
  while (points.length && points[0].time < p.time - 300) points.shift();
  drawCharts();
}

// -- formatting -----------------------------------------------------------------------------------
const int = (x) => (x === undefined || x === null ? "–" : Math.round(x).toLocaleString("en-US"));
const pct = (x) => (x === undefined || x === null ? "–" : (100 * x).toFixed(1) + "%");
const colourOrder = new Map();  // request id -> order of first sight: neighbours in time get distant hues
function hue(id) {
  if (!colourOrder.has(id)) {
    if (colourOrder.size > 10000) colourOrder.clear();
    colourOrder.set(id, colourOrder.size);
  }
  return Math.round(colourOrder.get(id) * 137.508) % 360;  // the golden angle
}
const requestColour = (id, light) => `hsl(${hue(id)}, 60%, ${light || 50}%)`;

function fitCanvas(canvas, cssHeight) {  // sharp on any pixel ratio
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 300;
  const height = cssHeight || canvas.clientHeight || 150;
  if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
  }
  canvas.style.height = height + "px";
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  return [ctx, width, height];
}

// -- KV cache and state slots ---------------------------------------------------------------------
let kvLayout = null;
function drawKvMap(s) {
  const kv = s.kv;
  const canvas = $("kv-map");
  const n = kv.cells.length;
  const width = canvas.clientWidth || 600;
  const cell = Math.max(3, Math.min(20, Math.floor(Math.sqrt((width * 200) / n))));
  const perRow = Math.max(1, Math.floor(width / cell));
  const [ctx] = fitCanvas(canvas, Math.ceil(n / perRow) * cell);
  const css = getComputedStyle(document.documentElement);
  const fixed = { f: css.getPropertyValue("--free"), c: css.getPropertyValue("--cached"),
    s: css.getPropertyValue("--shared") };
  for (let i = 0; i < n; i++) {
    const state = kv.cells[i];
    const owner = kv.owner[i];
    ctx.fillStyle = state === "u" ? (owner >= 0 ? requestColour(s.requests[owner].id) : "#888") : fixed[state];
    ctx.fillRect((i % perRow) * cell, Math.floor(i / perRow) * cell, cell - 1, cell - 1);
  }
  kvLayout = { cell, perRow, n, kv, requests: s.requests };
  $("kv-free").textContent = int(kv.free);
  $("kv-cached").textContent = int(kv.cached);
  $("kv-in-use").textContent = int(kv.in_use);
  $("kv-shared").textContent = int(kv.shared);
  $("kv-summary").textContent = `${int(kv.num_blocks)} blocks` +
    (kv.blocks_per_cell > 1 ? `, ${kv.blocks_per_cell} per cell` : "") + ` · ${pct(kv.usage)} in use`;
}

$("kv-map").addEventListener("mousemove", (e) => {
  if (!kvLayout) return;
  const { cell, perRow, n, kv, requests } = kvLayout;
  const i = Math.floor(e.offsetY / cell) * perRow + Math.floor(e.offsetX / cell);
  if (i < 0 || i >= n) return;
  const names = { f: "free", c: "cached, evictable", u: "in use", s: "shared" };
  const first = i * kv.blocks_per_cell;
  const owner = kv.owner[i] >= 0 ? " by " + requests[kv.owner[i]].id : "";
  $("kv-hover").textContent = `block ${first}` + (kv.blocks_per_cell > 1 ? `–${first + kv.blocks_per_cell - 1}` : "") +
    `: ${names[kv.cells[i]]}${owner}`;
});

function drawStateSlots(s) {
  $("state-panel").hidden = !s.state;
  if (!s.state) return;
  const st = s.state;
  const [ctx, width] = fitCanvas($("state-map"), 24);
  const w = Math.min(24, width / st.num_slots);
  st.owner.forEach((owner, i) => {
    ctx.fillStyle = owner === -2 ? "#e6e9ee" : owner >= 0 ? requestColour(s.requests[owner].id) : "#888";
    ctx.fillRect(i * w, 0, w - 1, 22);
  });
  const cp = st.checkpoints;
  $("state-summary").textContent = `${st.num_slots - st.free} of ${st.num_slots} held` +
    (cp ? ` · prefix checkpoints ${cp.valid + cp.pending} of ${cp.num}, ${cp.hits} hits` : "");
}

let stepLayout = null;
function drawSteps(last) {
  // one bar per engine step, the newest on the right; square-root scale: a step of a few decode tokens
  // stays visible beside a prefill of thousands
  const [ctx, width, height] = fitCanvas($("step-chart"), 160);
  let max = 1;
  for (const s of steps) max = Math.max(max, s[2] + s[3]);
  const h = (tokens) => Math.sqrt(tokens / max) * (height - 4);
  const w = width / MAX_STEPS;
  const x0 = width - steps.length * w;
  const bar = w > 3 ? w - 1 : Math.max(1, w);
  steps.forEach((s, i) => {
    const x = x0 + i * w;
    if (i > 0 && s[0] > steps[i - 1][0] + 1) {  // steps missing here (the page fell behind the ring)
      ctx.fillStyle = "#b3261e";
      ctx.fillRect(x - 0.5, 0, 1, height);
    }
    const total = h(s[2] + s[3]);
    const hd = h(s[3]);
    ctx.fillStyle = "#e07b39";
    ctx.fillRect(x, height - total, bar, total - hd);
    ctx.fillStyle = "#3a7bd5";
    ctx.fillRect(x, height - hd, bar, hd);
  });
  stepLayout = { x0, w };
  const span = steps.length > 1 ? steps[steps.length - 1][1] - steps[0][1] : 0;
  $("step-summary").textContent = `step ${int(last.num)}: ${int(last.prefill_tokens)} prefill + ` +
    `${int(last.decode_tokens)} decode tokens, ${last.num_requests} requests · ${steps.length} steps` +
    (span > 0 ? ` in ${span.toFixed(1)} s` : "") + ` · √ scale to ${int(max)}`;
}

$("step-chart").addEventListener("mousemove", (e) => {
  if (!stepLayout) return;
  const s = steps[Math.floor((e.offsetX - stepLayout.x0) / stepLayout.w)];
  $("step-hover").textContent = s ? `step ${int(s[0])}: ${int(s[2])} prefill + ${int(s[3])} decode tokens, ` +
    `${s[4]} requests, ${new Date(s[1] * 1000).toLocaleTimeString()}` : "";
});

function drawRequests(s) {
  const rows = s.requests.map((r) => {
    const done = r.prompt_tokens ? r.prompt_computed / r.prompt_tokens : 1;
    return `<tr><td><i class="dot" style="background:${requestColour(r.id)}"></i>${escapeHtml(r.id)}</td>` +
      `<td>${r.status}</td><td><span class="bar"><i style="width:${(100 * done).toFixed(1)}%"></i></span>` +
      `${r.prompt_computed} / ${r.prompt_tokens}${r.cached_tokens ? ` (${r.cached_tokens} cached)` : ""}</td>` +
      `<td>${r.output_tokens}${r.max_tokens ? " / " + r.max_tokens : ""}</td><td>${r.preemptions}</td>` +
      `<td>${r.blocks}</td><td>${r.age_s.toFixed(1)} s</td></tr>`;
  });
  document.querySelector("#requests tbody").innerHTML = rows.join("");
  const listed = s.requests.length < s.num_running + s.num_waiting ? ` (first ${s.requests.length} listed)` : "";
  $("requests-summary").textContent = `${s.num_running} running, ${s.num_waiting} waiting${listed}`;
}

function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

// -- time series ----------------------------------------------------------------------------------
const CHARTS = [
  ["chart-throughput", [["prompt_tps", "prompt", "#e07b39"], ["generation_tps", "generation", "#3a7bd5"]], 1],
  ["chart-ttft", [["ttft_p50", "p50", "#3a7bd5"], ["ttft_p99", "p99", "#b3261e"]], 1],
  ["chart-tpot", [["tpot_p50", "p50", "#3a7bd5"], ["tpot_p99", "p99", "#b3261e"]], 1],
  ["chart-kv", [["kv_usage", "in use", "#6a4fd9"]], 100],
  ["chart-prefix", [["prefix_hit_rate", "hit rate", "#2e7d32"]], 100],
  ["chart-preemptions", [["preemptions_per_s", "preemptions/s", "#b3261e"], ["waiting", "waiting", "#8a6d00"],
    ["running", "running", "#3a7bd5"]], 1],
  ["chart-spec", [["spec_acceptance", "accepted", "#2e7d32"]], 100],
];

function drawCharts() {
  for (const [id, series, scale] of CHARTS) {
    const canvas = $(id);
    if (canvas.offsetParent !== null) drawChart(canvas, series, scale);
  }
}

function drawChart(canvas, series, scale) {
  const [ctx, width, height] = fitCanvas(canvas, 150);
  const pad = { l: 44, r: 8, t: 18, b: 16 };
  const now = points.length ? points[points.length - 1].time : Date.now() / 1000;
  const t0 = now - 300;
  let max = 0;
  for (const p of points) for (const [k] of series) if (p[k] !== null && p[k] !== undefined) max = Math.max(max, p[k] * scale);
  max = max > 0 ? niceCeil(max) : 1;
  const x = (t) => pad.l + ((t - t0) / 300) * (width - pad.l - pad.r);
  const y = (v) => height - pad.b - (v / max) * (height - pad.t - pad.b);
  ctx.strokeStyle = "#dde1e7";
  ctx.fillStyle = "#6b7380";
  ctx.font = "10px system-ui, sans-serif";
  for (let i = 0; i <= 2; i++) {
    const v = (max * i) / 2;
    ctx.beginPath(); ctx.moveTo(pad.l, y(v)); ctx.lineTo(width - pad.r, y(v)); ctx.stroke();
    ctx.fillText(formatAxis(v), 2, y(v) + 3);
  }
  ctx.fillText("−5 min", pad.l, height - 3);
  ctx.fillText("now", width - pad.r - 18, height - 3);
  let lx = pad.l;
  for (const [k, label, colour] of series) {
    ctx.strokeStyle = colour;
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let pen = false;
    for (const p of points) {
      const v = p[k];
      if (v === null || v === undefined || p.time < t0) { pen = false; continue; }
      if (pen) ctx.lineTo(x(p.time), y(v * scale)); else ctx.moveTo(x(p.time), y(v * scale));
      pen = true;
    }
    ctx.stroke();
    ctx.fillStyle = colour;
    points.forEach((p, i) => {  // a lone point (no neighbour to draw a line to) gets a dot
      const lone = (j) => j < 0 || j >= points.length || points[j][k] === null || points[j][k] === undefined;
      if (!lone(i) && p.time >= t0 && lone(i - 1) && lone(i + 1)) ctx.fillRect(x(p.time) - 1.5, y(p[k] * scale) - 1.5, 3, 3);
    });
    const latest = points.length ? points[points.length - 1][k] : null;
    ctx.fillStyle = colour;
    const text = `${label} ${latest === null || latest === undefined ? "–" : formatAxis(latest * scale)}`;
    ctx.fillText(text, lx, 11);
    lx += ctx.measureText(text).width + 12;
  }
  ctx.lineWidth = 1;
}

function niceCeil(v) {
  const e = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * e >= v) return m * e;
  return 10 * e;
}

function formatAxis(v) {
  if (v === 0) return "0";
  if (Math.abs(v) >= 1000) return (v / 1000).toFixed(1) + "k";
  if (Math.abs(v) >= 10) return v.toFixed(0);
  if (Math.abs(v) >= 1) return v.toFixed(1);
  return v.toPrecision(2);
}

window.addEventListener("resize", () => { drawCharts(); if (lastState) onState(lastState); });
start().catch((e) => setStatus("failed: " + e, "down"));
