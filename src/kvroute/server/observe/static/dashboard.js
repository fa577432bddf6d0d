// kvroute live dashboard: polls debug/dashboard with the admin token (kept in sessionStorage) and
// renders it. Plain DOM, no dependencies, no build step. Every string from the server goes in
// through textContent (request ids come from clients), never as HTML.
"use strict";

const KEY = "kvroute-admin-token";
const POLL_MS = 1500;
const SVG = "http://www.w3.org/2000/svg";
const expanded = new Set(); // request ids whose breakdown is open
let timer = null;

function $(id) { return document.getElementById(id); }

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v; else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : String(c));
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  return node;
}

function fmt(x, digits) {
  if (x === null || x === undefined) return "–";
  if (typeof x !== "number") return String(x);
  if (!Number.isFinite(x)) return x > 0 ? "∞" : "−∞";
  if (Number.isInteger(x) && Math.abs(x) < 1e15) return x.toLocaleString("en-US");
  const a = Math.abs(x);
  if (a >= 1e6) return x.toExponential(2);
  return x.toFixed(digits === undefined ? (a >= 100 ? 0 : a >= 1 ? 1 : 3) : digits);
}

function pct(x) { return x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%"; }

// ---- token ---------------------------------------------------------------------------------------

function takeTokenFromHash() {
  const m = /(?:^#|&)token=([^&]*)/.exec(location.hash);
  if (m) {
    sessionStorage.setItem(KEY, decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
}

function askToken(message) {
  if (timer !== null) { clearTimeout(timer); timer = null; }
  $("login").hidden = false;
  $("login-error").textContent = message || "";
  $("status").textContent = "waiting for the admin token";
  $("token").focus();
}

$("login").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const t = $("token").value.trim();
  if (!t) return;
  sessionStorage.setItem(KEY, t);
  $("token").value = "";
  $("login").hidden = true;
  poll();
});

// ---- polling -------------------------------------------------------------------------------------

async function poll() {
  timer = null;
  const token = sessionStorage.getItem(KEY);
  if (!token) { askToken(); return; }
  if (document.hidden) return; // resumed by visibilitychange
  let resp;
  try {
    resp = await fetch("debug/dashboard?limit=20", {
      headers: { Authorization: "Bearer " + token }, cache: "no-store",
    });
  } catch (err) {
    setStatus("router unreachable; retrying", true);
    schedule();
    return;
  }
  if (resp.status === 401) {
    sessionStorage.removeItem(KEY);
    askToken("that token was refused");
    return;
  }
  if (!resp.ok) {
    setStatus("router answered " + resp.status + "; retrying", true);
    schedule();
    return;
  }
  const state = await resp.json();
  $("login").hidden = true;
  $("main").hidden = false;
  render(state);
  setStatus("updated " + new Date(state.time * 1000).toLocaleTimeString(), false);
  schedule();
}

function schedule() { if (timer === null) timer = setTimeout(poll, POLL_MS); }

function setStatus(text, bad) {
  const s = $("status");
  s.textContent = text;
  s.classList.toggle("bad", bad);
}

document.addEventListener("visibilitychange", () => {
  if (!document.hidden && timer === null && sessionStorage.getItem(KEY)) poll();
});

// ---- rendering -----------------------------------------------------------------------------------

function render(s) {
  $("policy").textContent = s.policy;
  $("features").textContent = s.features.length ? "features: " + s.features.join(", ") : "no features on";
  renderCards(s);
  renderBackends(s.backends);
  renderScore(s.score);
  renderHotspots(s.hotspot);
  renderDecisions(s.decisions);
}

function renderCards(s) {
  const c = s.counters;
  $("rate").textContent = fmt(s.rate.decisions_per_s, 1);
  $("decisions-total").textContent = fmt(s.decisions_total);
  $("requests-total").textContent = fmt(s.requests_total);
  $("requests-ok").textContent = fmt(c.ok);
  $("requests-errors").textContent = fmt(c.client_errors + c.upstream_errors + c.unavailable);
  $("retries").textContent = fmt(c.retries);
  sparkline($("rate-chart"), s.rate.per_second);
  const sc = s.score;
  if (sc === null) {
    $("score-p95").textContent = "off";
    $("score-state").textContent = "start the router with --score-monitor";
    $("score-state").className = "muted";
  } else {
    $("score-p95").textContent = fmt(sc.p95);
    $("score-state").textContent = sc.alerting
      ? "ALERT: " + sc.persist + " decisions in a row above p" + sc.quantile * 100
      : "no alert · " + fmt(sc.alerts) + " alerts so far";
    $("score-state").className = sc.alerting ? "bad" : "muted";
  }
  const h = s.hotspot;
  if (h === null) {
    $("hotspot-active").textContent = "off";
    $("hotspot-state").textContent = "start the router with --hotspot-mitigation";
    $("hotspot-state").className = "muted";
  } else {
    $("hotspot-active").textContent = fmt(h.active.length);
    $("hotspot-state").textContent = "alarms " + fmt(h.alarms) + " · mitigations " + fmt(h.mitigations)
      + " · cleared " + fmt(h.clears);
    $("hotspot-state").className = h.active.length ? "bad" : "muted";
  }
}

function sparkline(node, values) {
  node.replaceChildren();
  const w = 240, h = 48, n = values.length;
  const top = Math.max(1, ...values);
  const step = w / Math.max(1, n);
  values.forEach((v, i) => {
    const bh = (v / top) * (h - 2);
    node.append(svg("rect", { x: i * step, y: h - bh, width: Math.max(1, step - 1), height: bh, class: "bar" }));
  });
}

function renderBackends(backends) {
  const body = $("backends").tBodies[0];
  body.replaceChildren();
  const most = Math.max(1, ...backends.map((b) => b.queued_prefill_tokens));
  for (const b of backends) {
    const health = b.state !== "active" ? b.state : b.healthy ? "healthy" : "unhealthy";
    const bar = el("div", { class: "meter" }, el("span", { class: "fill" }));
    bar.firstChild.style.width = (100 * b.queued_prefill_tokens / most).toFixed(1) + "%";
    const row = el("tr", { "data-backend": b.url },
      el("td", {}, b.index),
      el("td", { class: "url" }, b.url),
      el("td", { class: b.healthy ? "good health" : "bad health" }, health + (b.warming ? " · warming" : "")),
      el("td", { class: "kv-mode" }, b.kv_mode),
      el("td", { class: "num waiting" }, fmt(b.waiting)),
      el("td", { class: "num running" }, fmt(b.running)),
      el("td", { class: "prefill" }, bar, el("span", { class: "num queued-prefill" }, fmt(b.queued_prefill_tokens))),
      el("td", { class: "num routed" }, fmt(b.requests_total)),
      el("td", { class: "num hit-rate" }, pct(b.hit_rate)),
      el("td", { class: "num cached-error" }, fmt(b.cached_error_mean, 1)),
      el("td", { class: "num ttft" }, fmt(b.ttft_ms_mean, 1)),
      el("td", { class: "num e2e" }, fmt(b.e2e_ms_mean, 1)),
    );
    body.append(row);
  }
}

function renderScore(sc) {
  const node = $("score-chart");
  node.replaceChildren();
  if (sc === null) { $("score-note").textContent = "Score monitor off (--score-monitor)."; return; }
  const b = sc.buckets;
  $("score-note").textContent = b.length
    ? fmt(sc.count) + " decisions · mean " + fmt(sc.mean) + " · max " + fmt(sc.max)
      + " · dashed line: rolling p" + sc.quantile * 100 + (sc.p95 === null ? " (after the first refresh)" : "")
    : "No decision yet.";
  if (!b.length) return;
  const W = 480, H = 160, pad = 18;
  const top = Math.max(1, ...b.map((x) => x.count));
  const step = (W - 2) / b.length;
  b.forEach((x, i) => {
    const bh = (x.count / top) * (H - 2 * pad);
    const above = sc.p95 !== null && (x.le === null || x.le > sc.p95);
    node.append(svg("rect", { x: 1 + i * step, y: H - pad - bh, width: Math.max(1, step - 2), height: bh,
      class: above ? "bar above" : "bar" }));
    if (b.length <= 12 || i % Math.ceil(b.length / 12) === 0) {
      const t = svg("text", { x: 1 + i * step + step / 2, y: H - 4, class: "axis" });
      t.textContent = x.le === null ? "+∞" : "≤" + fmt(x.le);
      node.append(t);
    }
  });
  if (sc.p95 !== null) {
    // the p95 falls in the first bucket whose upper bound reaches it
    let k = b.findIndex((x) => x.le === null || x.le >= sc.p95);
    if (k < 0) k = b.length - 1;
    const x = 1 + (k + 1) * step;
    node.append(svg("line", { x1: x, x2: x, y1: 4, y2: H - pad, class: "p95" }));
    const t = svg("text", { x: Math.min(x + 3, W - 60), y: 14, class: "axis" });
    t.textContent = "p" + sc.quantile * 100 + " " + fmt(sc.p95);
    node.append(t);
  }
}

function renderHotspots(h) {
  const body = $("hotspots").tBodies[0];
  const list = $("hotspot-events");
  body.replaceChildren();
  list.replaceChildren();
  if (h === null) { $("hotspot-note").textContent = "Hot-spot detection off (--hotspot-mitigation)."; return; }
  $("hotspot-note").textContent = h.active.length ? "" : "No class in alarm.";
  for (const a of h.active) {
    body.append(el("tr", {}, el("td", {}, a.key), el("td", { class: "num" }, pct(a.share)),
      el("td", { class: "num" }, a.holders + "/" + a.instances),
      el("td", { class: a.mitigating ? "bad" : "warn" }, a.mitigating ? "mitigating" : "alarm")));
  }
  for (const e of h.events) {
    list.append(el("li", {}, fmt(e.age_s, 0) + " s ago: " + e.kind + " " + e.key + " share " + pct(e.share)
      + " on " + e.holders + "/" + e.instances));
  }
}

function renderDecisions(decisions) {
  const body = $("decisions").tBodies[0];
  body.replaceChildren();
  for (const d of decisions) {
    const o = d.outcome;
    const used = d.backend || d.winner;
    const cand = used ? d.candidates.find((c) => c.index === used.index) : undefined;
    const row = el("tr", { class: "decision", "data-request-id": d.request_id },
      el("td", {}, new Date(d.time * 1000).toLocaleTimeString()),
      el("td", { class: "rid" }, d.request_id),
      el("td", {}, d.policy),
      el("td", { class: d.reason === "policy" ? "" : "warn" }, d.reason),
      el("td", { class: "url" }, used ? used.backend : "–"),
      el("td", { class: "num" }, fmt(d.prompt_tokens)),
      el("td", { class: "num" }, fmt(d.expected_cached_tokens)),
      el("td", { class: "num" }, o ? fmt(o.cached_tokens) : "…"),
      el("td", { class: "num" }, cand ? fmt(cand.score) : "–"),
      el("td", { class: "num" }, o ? fmt(o.ttft_ms, 1) : "…"),
      el("td", { class: "num" }, o ? fmt(o.e2e_ms, 1) : "…"),
      el("td", {}, o ? String(o.status) : "in flight"),
    );
    row.addEventListener("click", () => {
      if (expanded.has(d.request_id)) expanded.delete(d.request_id); else expanded.add(d.request_id);
      renderDecisions(decisions);
    });
    body.append(row);
    if (expanded.has(d.request_id)) body.append(breakdown(d, used));
  }
}

function breakdown(d, used) {
  const head = el("tr", {}, ...["#", "backend", "cached", "P-token", "queued prefill", "BS", "score"]
    .map((t) => el("th", {}, t)));
  const table = el("table", { class: "candidates" }, el("thead", {}, head));
  const tb = el("tbody", {});
  for (const c of d.candidates) {
    const cls = used && c.index === used.index ? "chosen" : d.winner && c.index === d.winner.index ? "winner" : "";
    tb.append(el("tr", { class: cls }, el("td", {}, c.index), el("td", { class: "url" }, c.backend),
      el("td", { class: "num" }, fmt(c.cached_tokens)), el("td", { class: "num" }, fmt(c.p_token)),
      el("td", { class: "num" }, fmt(c.queued_prefill_tokens)), el("td", { class: "num" }, fmt(c.bs)),
      el("td", { class: "num" }, fmt(c.score))));
  }
  table.append(tb);
  const notes = [
    "reason: " + d.reason + (d.decision_reason !== d.reason ? " (core: " + d.decision_reason + ")" : ""),
    "routing " + fmt(d.routing_ms, 3) + " ms", "retries " + d.retries,
  ];
  if (d.outcome && d.outcome.cached_error !== null) notes.push("cached error (real − expected) " + fmt(d.outcome.cached_error));
  for (const s of d.shadow) {
    notes.push("shadow " + s.policy + ": " + (s.agree ? "agrees" : "backend " + s.index
      + ", score diff " + fmt(s.score_diff) + ", cached diff " + fmt(s.cached_diff)));
  }
  const cell = el("td", { colspan: "12" }, table, el("p", { class: "muted" }, notes.join(" · ")));
  return el("tr", { class: "breakdown" }, cell);
}

// ---- start ---------------------------------------------------------------------------------------

takeTokenFromHash();
poll();
