"use strict";
// peertrain's dashboard: polls the daemon's feed (api/status, peer/dashboard/feed.py) and redraws. Every value
// shown may come from a peer (IDs, reasons): it is only ever written as text (textContent, SVG attributes),
// never parsed as HTML.
(function () {
  const POLL_MS = 1500;
  const SCHEMA = 1;
  const SVG_NS = "http://www.w3.org/2000/svg";
  const token = new URLSearchParams(window.location.search).get("token");
  const STATE_COLOURS = { self: "#5aa9ff", connected: "#4cc38a", dead: "#ff6b6b", known: "#6b7785" };
  const STAGE_COLOURS = ["#e6a23c", "#9b7bff", "#36c5d6", "#f06595", "#94d82d", "#ffa94d", "#4dabf7", "#da77f2"];

  const $ = (id) => document.getElementById(id);

  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }

  function svg(tag, attrs, text) {
    const e = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
    if (text !== undefined) e.textContent = String(text);
    return e;
  }

  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }
  function short(id) { return id ? String(id).slice(0, 8) : ""; }
  function num(v, digits) { return v === null || v === undefined ? "–" : Number(v).toFixed(digits); }

  function bytes(n) {
    if (!n) return "0";
    const units = ["B", "KB", "MB", "GB", "TB"];
    let i = 0;
    while (n >= 1000 && i < units.length - 1) { n /= 1000; i++; }
    return n.toFixed(n < 10 && i ? 1 : 0) + " " + units[i];
  }

  function tick(v) { return v !== 0 && Math.abs(v) < 0.01 ? v.toExponential(1) : String(Number(v.toPrecision(3))); }

  function bps(v) { return v ? bytes(v / 8).replace("B", "B/s") : "not measured"; }

  function fact(parent, label, value, cls) {
    const s = el("span");
    s.appendChild(document.createTextNode(label + " "));
    const b = el("b", value, cls);
    s.appendChild(b);
    parent.appendChild(s);
    return b;
  }

  function renderMe(f) {
    const m = f.me;
    $("me-swarm").textContent = "swarm " + m.swarm;
    const me = $("me");
    clear(me);
    fact(me, "peer", m.peer_id).id = "me-id";
    fact(me, "listen", m.listen);
    fact(me, "version", m.version);
    fact(me, "up", num(m.uptime_s, 0) + " s");
    fact(me, "connected", m.connected);
  }

  function renderReach(r) {
    const box = $("reach");
    clear(box);
    const cls = r.reachability === "public" ? "good" : r.reachability === "nat" ? "warn" : "";
    fact(box, "reachability", r.reachability, cls).id = "reachability";
    if (r.nat_mapping) fact(box, "NAT mapping", r.nat_mapping);
    fact(box, "advertised", r.advertised.join(", ") || "none");
    fact(box, "relays we use", r.relays.map((x) => short(x.peer_id) + " " + x.address).join(", ") || "none");
    fact(box, "hole punches", r.punches.succeeded + " ok / " + r.punches.failed + " failed of " + r.punches.attempts);
    fact(box, "relaying for others", r.relaying.offering ? r.relaying.reservations + " reservations, " + r.relaying.circuits + " circuits" : "no");
    const why = el("div", r.reason, "dim");
    why.id = "reach-reason";
    box.appendChild(why);
  }

  function nodeColour(n) {
    if (n.stage !== null && n.stage !== undefined) return STAGE_COLOURS[n.stage % STAGE_COLOURS.length];
    return STATE_COLOURS[n.state] || "#f0b45a";
  }

  function renderGraph(g) {
    const area = $("graph");
    clear(area);
    const W = 520, H = 360, cx = W / 2, cy = H / 2, R = Math.min(W, H) / 2 - 40;
    // around the circle in depth-first order from this daemon (at the top), neighbours by ID: a ring or a
    // path is drawn without crossings, and the picture is stable between polls
    const adj = new Map(g.nodes.map((n) => [n.id, []]));
    for (const e of g.edges) { adj.get(e.a).push(e.b); adj.get(e.b).push(e.a); }
    const byId = new Map(g.nodes.map((n) => [n.id, n]));
    const start = g.nodes.filter((n) => n.me).concat(g.nodes.slice().sort((a, b) => (a.id < b.id ? -1 : 1)));
    const nodes = [], seen = new Set();
    for (const s of start) {
      const stack = [s.id];
      while (stack.length) {
        const id = stack.pop();
        if (seen.has(id)) continue;
        seen.add(id);
        nodes.push(byId.get(id));
        for (const nb of adj.get(id).slice().sort().reverse()) if (!seen.has(nb)) stack.push(nb);
      }
    }
    const pos = new Map();
    nodes.forEach((n, i) => {
      const a = -Math.PI / 2 + (2 * Math.PI * i) / Math.max(1, nodes.length);
      pos.set(n.id, [cx + R * Math.cos(a), cy + R * Math.sin(a)]);
    });
    const maxW = Math.max(1e-9, ...g.edges.map((e) => e.weight || 0));
    for (const e of g.edges) {
      const [x1, y1] = pos.get(e.a), [x2, y2] = pos.get(e.b);
      // width: log of the measured bandwidth (1 Mbit/s thin, 10 Gbit/s thick); opacity: the mixing weight
      const w = e.bandwidth_bps ? 1 + 5 * Math.min(1, Math.max(0, Math.log10(e.bandwidth_bps / 1e6) / 4)) : 1;
      const line = svg("line", { x1, y1, x2, y2, class: "edge", "stroke-width": w.toFixed(2),
        "stroke-opacity": (0.35 + 0.65 * (e.weight || 0) / maxW).toFixed(2), "data-a": e.a, "data-b": e.b });
      line.appendChild(svg("title", {}, short(e.a) + " – " + short(e.b) + ": " + bps(e.bandwidth_bps) +
        ", weight " + num(e.weight, 3) + (e.rtt_s ? ", RTT " + (e.rtt_s * 1000).toFixed(1) + " ms" : "")));
      area.appendChild(line);
      if (e.weight) {
        area.appendChild(svg("text", { x: (x1 + x2) / 2, y: (y1 + y2) / 2 - 3, "text-anchor": "middle",
          class: "edge-label", fill: "#8a96a3" }, num(e.weight, 2)));
      }
    }
    for (const n of nodes) {
      const [x, y] = pos.get(n.id);
      const c = svg("circle", { cx: x, cy: y, r: n.me ? 14 : 11, fill: nodeColour(n),
        class: "node" + (n.neighbour ? " neighbour" : ""), "data-id": n.id, "data-state": n.state,
        "data-stage": n.stage === null ? "" : n.stage });
      c.appendChild(svg("title", {}, n.id + " (" + n.state + (n.stage !== null ? ", stage " + n.stage : "") +
        ", degree " + n.degree + ")"));
      area.appendChild(c);
      const label = short(n.id) + (n.stage !== null ? " · s" + n.stage : "");
      area.appendChild(svg("text", { x, y: y + (y < cy ? -18 : 26), "text-anchor": "middle", class: "node-label" }, label));
    }
    area.dataset.nodes = String(nodes.length);
    area.dataset.edges = String(g.edges.length);
    $("graph-counts").textContent = g.nodes_total + " nodes, " + g.edges_total + " edges" +
      (g.nodes_total > g.nodes.length ? " (" + g.nodes.length + " drawn)" : "");
    const facts = $("graph-facts");
    clear(facts);
    fact(facts, "kind", g.kind);
    fact(facts, "spectral gap", num(g.spectral_gap, 3)).id = "spectral-gap";
    fact(facts, "our degree", g.degree);
    fact(facts, "rewiring moves", g.moves);
    const last = el("div", "last move: " + (g.last_move || "none yet"), "dim");
    last.id = "last-move";
    facts.appendChild(last);
  }

  // One colour per peer's curve, from its ID (so a peer keeps its colour between polls); this daemon's is
  // the loss orange it always had.
  const OWN_CURVE = "#f0b45a";
  const CURVE_COLOURS = ["#5aa9ff", "#4cc38a", "#da77f2", "#36c5d6", "#ff6b6b", "#94d82d", "#9b7bff", "#f06595",
    "#ffd43b", "#63e6be", "#a9b4c2"];

  function curveColour(id, mine) {
    if (mine) return OWN_CURVE;
    let h = 0;
    for (const ch of String(id)) h = (h * 31 + ch.charCodeAt(0)) >>> 0;
    return CURVE_COLOURS[h % CURVE_COLOURS.length];
  }

  function renderLegend(curves, me, total) {
    const box = $("loss-legend");
    clear(box);
    for (const [id, pts] of curves) {
      const item = el("span", null, "curve-key");
      item.dataset.peer = id;
      const sw = svg("svg", { width: 12, height: 12, viewBox: "0 0 12 12", class: "swatch" });
      sw.appendChild(svg("rect", { x: 1, y: 1, width: 10, height: 10, rx: 2, fill: curveColour(id, id === me) }));
      item.appendChild(sw);
      const last = pts.filter((p) => p[1] !== null).pop();
      item.appendChild(document.createTextNode(" " + short(id) + (id === me ? " (us)" : "") +
        (last ? " " + num(last[1], 3) : "")));
      box.appendChild(item);
    }
    if (total > curves.length) box.appendChild(el("span", "+" + (total - curves.length) + " more peers", "dim"));
  }

  function renderTraining(t, me) {
    const area = $("loss");
    clear(area);
    const facts = $("training-facts");
    clear(facts);
    clear($("loss-legend"));
    if (!t) {
      $("training-state").textContent = "no trainer";
      area.dataset.points = "0";
      area.dataset.curves = "0";
      return;
    }
    $("training-state").textContent = t.trainer ? t.trainer + ": " + t.state : "other peers' figures";
    if (t.trainer) {
      fact(facts, "step", t.step === null ? "–" : t.step);
      fact(facts, "loss", num(t.loss, 4)).id = "loss-now";
      if (t.accuracy !== null) fact(facts, "accuracy", (100 * t.accuracy).toFixed(1) + "%");
      if (t.samples_per_s !== null) fact(facts, "samples/s", num(t.samples_per_s, 1));
    }
    // this daemon's curve first, then the other peers' (from their signed records), as the feed orders them
    const curves = Object.entries(t.curves);
    renderLegend(curves, me, t.curves_total);
    const W = 520, H = 220, L = 52, Rm = 40, T = 24, B = 26;
    const points = curves.map(([, pts]) => pts).flat();
    const loss = points.filter((p) => p[1] !== null);
    const acc = points.filter((p) => p[2] !== null);
    area.dataset.points = String(loss.length);
    area.dataset.curves = String(curves.filter(([, pts]) => pts.some((p) => p[1] !== null)).length);
    if (!points.length) {
      area.appendChild(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", fill: "#8a96a3" }, "no figures yet"));
      return;
    }
    const t0 = Math.min(...points.map((p) => p[0])), t1 = Math.max(...points.map((p) => p[0]));
    const span = Math.max(1e-3, t1 - t0);
    const x = (tt) => L + (W - L - Rm) * (tt - t0) / span;
    const lmin = Math.min(...loss.map((p) => p[1]), Infinity), lmax = Math.max(...loss.map((p) => p[1]), -Infinity);
    const logScale = loss.length && lmin > 0 && lmax / lmin > 20;
    const f = (v) => (logScale ? Math.log10(v) : v);
    const lo = loss.length ? f(lmin) : 0, hi = loss.length ? f(lmax) : 1;
    const yl = (v) => T + (H - T - B) * (1 - (f(v) - lo) / Math.max(1e-9, hi - lo));
    const ya = (v) => T + (H - T - B) * (1 - v);
    area.appendChild(svg("line", { x1: L, y1: H - B, x2: W - Rm, y2: H - B, class: "axis" }));
    area.appendChild(svg("line", { x1: L, y1: T, x2: L, y2: H - B, class: "axis" }));
    area.appendChild(svg("text", { x: L - 4, y: T + 8, "text-anchor": "end" }, loss.length ? tick(lmax) : ""));
    area.appendChild(svg("text", { x: L - 4, y: H - B, "text-anchor": "end" }, loss.length ? tick(lmin) : ""));
    area.appendChild(svg("text", { x: L, y: H - 8 }, "0 s"));
    area.appendChild(svg("text", { x: W - Rm, y: H - 8, "text-anchor": "end" }, span.toFixed(1) + " s"));
    area.appendChild(svg("text", { x: 4, y: 12, fill: OWN_CURVE }, "loss" + (logScale ? " (log scale)" : "")));
    if (acc.length) {
      area.appendChild(svg("text", { x: W - Rm, y: 12, fill: "#4cc38a", "text-anchor": "end" }, "held-out accuracy (dashed)"));
      area.appendChild(svg("text", { x: W - Rm + 4, y: T + 8 }, "100%"));
      area.appendChild(svg("text", { x: W - Rm + 4, y: H - B }, "0%"));
    }
    // the others' lines under this daemon's, which is drawn last (on top)
    for (const [id, pts] of curves.slice().reverse()) {
      const mine = id === me, colour = curveColour(id, mine), r = mine ? 2.5 : 1.8;
      const a = pts.filter((p) => p[2] !== null), l = pts.filter((p) => p[1] !== null);
      if (a.length) {
        area.appendChild(svg("polyline", { class: "acc-line", stroke: colour, "data-peer": id,
          points: a.map((p) => x(p[0]) + "," + ya(p[2])).join(" ") }));
        for (const p of a) area.appendChild(svg("circle", { cx: x(p[0]), cy: ya(p[2]), r, fill: colour, class: "acc-point" }));
      }
      if (l.length) {
        const line = svg("polyline", { class: "loss-line" + (mine ? " mine" : ""), stroke: colour, "data-peer": id,
          points: l.map((p) => x(p[0]) + "," + yl(p[1])).join(" ") });
        line.appendChild(svg("title", {}, id + (mine ? " (this daemon)" : "") + ": loss " + num(l[l.length - 1][1], 4)));
        area.appendChild(line);
        for (const p of l) area.appendChild(svg("circle", { cx: x(p[0]), cy: yl(p[1]), r, fill: colour, class: "loss-point" }));
      }
    }
  }

  function renderPipeline(p) {
    const panel = $("pipeline-panel");
    panel.hidden = !p;
    if (!p) return;
    $("pipeline-name").textContent = p.pipeline + ", " + p.stages + " stages, this daemon: " + (p.role || "none") +
      (p.my_stage !== null ? " of stage " + p.my_stage : "");
    const box = $("stages");
    clear(box);
    const maxCap = Math.max(1e-9, ...p.stage_map.map((s) => s.capacity || 0));
    for (const s of p.stage_map) {
      const d = el("div", null, "stage" + (s.stage === p.bottleneck ? " bottleneck" : ""));
      d.dataset.stage = String(s.stage);
      d.appendChild(el("b", "stage " + s.stage));
      if (s.stage === p.bottleneck) {
        const tag = el("div", "bottleneck", "tag");
        tag.id = "bottleneck";
        d.appendChild(tag);
      }
      d.appendChild(el("div", "capacity " + num(s.capacity, 1) + " samples/s", "dim"));
      const bar = el("div", null, "bar");
      const b = svg("svg", { viewBox: "0 0 100 6", preserveAspectRatio: "none" });
      b.appendChild(svg("rect", { x: 0, y: 0, height: 6, width: (100 * (s.capacity || 0) / maxCap).toFixed(1),
        fill: s.stage === p.bottleneck ? "#ff6b6b" : "#4cc38a" }));
      bar.appendChild(b);
      d.appendChild(bar);
      const ul = el("ul");
      for (const q of s.peers) {
        ul.appendChild(el("li", short(q.peer_id) + (q.me ? " (us)" : "") + ": " + num(q.samples_per_s, 1) +
          "/s, queue " + q.queue + (q.moving_to !== null ? ", moving to " + q.moving_to : "")));
      }
      if (s.peers_total > s.peers.length) ul.appendChild(el("li", "+" + (s.peers_total - s.peers.length) + " more"));
      d.appendChild(ul);
      box.appendChild(d);
    }
    box.dataset.stages = String(p.stage_map.length);
    box.dataset.bottleneck = p.bottleneck === null ? "" : String(p.bottleneck);
    const facts = $("pipeline-facts");
    clear(facts);
    if (p.driver) {
      fact(facts, "microbatches done", p.driver.done).id = "mb-done";
      fact(facts, "retried", p.driver.retried);
      fact(facts, "failed", p.driver.failed, p.driver.failed ? "bad" : "");
      fact(facts, "in flight", p.driver.in_flight);
    }
    fact(facts, "served", p.server.served);
    fact(facts, "server queue", p.server.queue);
    fact(facts, "moves", p.moves_total);
    const moves = $("moves");
    clear(moves);
    for (const m of p.moves) {
      moves.appendChild(el("li", Object.entries(m).filter(([k]) => k !== "at").map(([k, v]) => k + " " + v).join(", ")));
    }
  }

  function renderPeers(peers) {
    const count = $("peer-count");
    count.textContent = peers.total + " known" + (peers.total > peers.shown ? ", " + peers.shown + " shown" : "") +
      " (" + Object.entries(peers.by_state).map(([k, v]) => v + " " + k).join(", ") + ")";
    count.dataset.total = String(peers.total);
    count.dataset.shown = String(peers.shown);
    const body = $("peers").tBodies[0];
    clear(body);
    for (const p of peers.rows) {
      const tr = el("tr", null, "peer-row");
      tr.dataset.peer = p.peer_id;
      tr.dataset.state = p.state;
      const path = p.path ? p.path + (p.via ? " via " + short(p.via) : "") : "";
      const cells = [[p.peer_id], [p.state, p.state === "connected" ? "good" : p.state === "dead" ? "bad" : ""],
        [path], [p.address], [num(p.rtt_ms, 1), "num"], [bytes(p.bytes_in), "num"], [bytes(p.bytes_out), "num"],
        [p.exchanges, "num"], [p.clip_rate === null ? "–" : (100 * p.clip_rate).toFixed(0) + "%", "num"],
        [p.banned || "", p.banned ? "bad" : ""]];
      for (const [text, cls] of cells) tr.appendChild(el("td", text, cls));
      body.appendChild(tr);
    }
  }

  function renderBans(bans) {
    const c = $("ban-count");
    c.textContent = bans.total ? String(bans.total) : "none";
    c.dataset.total = String(bans.total);
    const ul = $("bans");
    clear(ul);
    for (const b of bans.rows) ul.appendChild(el("li", b.peer_id + ": " + b.reason));
  }

  function render(f) {
    renderMe(f);
    renderReach(f.reachability);
    renderGraph(f.graph);
    renderTraining(f.training, f.me.peer_id);
    renderPipeline(f.pipeline);
    renderPeers(f.peers);
    renderBans(f.bans);
    $("updated").textContent = "updated " + new Date(f.generated_at * 1000).toLocaleTimeString();
    document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
  }

  async function poll() {
    try {
      const r = await fetch("api/status", { cache: "no-store", headers: token ? { Authorization: "Bearer " + token } : {} });
      if (!r.ok) throw new Error("the daemon answered HTTP " + r.status + (r.status === 401 ? " (open the page with ?token=...)" : ""));
      const f = await r.json();
      if (f.schema !== SCHEMA) throw new Error("feed schema " + f.schema + ", this page reads " + SCHEMA);
      render(f);
      $("error").textContent = "";
    } catch (e) {
      $("error").textContent = "cannot read the daemon's status: " + e.message;
    } finally {
      window.setTimeout(poll, POLL_MS);
    }
  }

  poll();
})();
