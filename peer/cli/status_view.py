"""Rendering `peer status` for people (rich tables); `--json` bypasses all of this."""

from __future__ import annotations

import time

from rich.markup import escape
from rich import box
from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from peer.cli.pipeline_view import SUMMARY_COLUMNS, render_pipeline, stage_summary, summary_cells

STATE_STYLE = {"connected": "green", "connecting": "yellow", "discovered": "cyan", "dead": "red"}
SPARK = "▁▂▃▄▅▆▇█"


def trainer_failure(trainer: dict | None) -> str | None:
    """The one-line cause when a daemon's trainer has failed (its state is "failed: ..."), else None."""
    state = (trainer or {}).get("state") or ""
    return state.removeprefix("failed:").strip() if state.startswith("failed") else None


def human_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1000
    return str(n)


def human_duration(s: float | None) -> str:
    if s is None:
        return "-"
    s = float(s)
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{s // 60:.0f}m{s % 60:02.0f}s"
    return f"{s // 3600:.0f}h{(s % 3600) // 60:02.0f}m"


def _mbit(n: dict) -> str:
    """A neighbour's measured bandwidth in Mbit/s, with the factor it is good to (one standard error)."""
    mbit = f"{n['bandwidth_bps'] / 1e6:.0f}"
    spread = n.get("bandwidth_spread")
    return f"{mbit} ×÷{spread:.1f}" if spread else mbit


def sparkline(values: list[float], width: int = 24) -> str:
    vals = [v for v in values if v is not None][-width:]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    span = (hi - lo) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / span * (len(SPARK) - 1)))] for v in vals)


def _facts() -> Table:
    """A grid of labelled facts: the label in bold, its value beside it."""
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    return t


def render_status(st: dict):
    head = _facts()
    head.add_row("peer", st["peer_id"])
    head.add_row("swarm", f"{st['swarm']}   (protocol v{st['protocol_version']}, peertrain {st['version']})")
    head.add_row("listen", f"{st['listen']}   mDNS {'on' if st['mdns'] else 'off'}   cipher {'/'.join(st['ciphers'])}")
    head.add_row("uptime", f"{human_duration(st['uptime_s'])}   pid {st['pid']}   home {st['home']}")
    head.add_row("peers", f"{st['connected']} connected of {len(st['peers'])} known")
    if (st.get("metrics") or {}).get("listen"):
        head.add_row("metrics", f"http://{st['metrics']['listen']}{st['metrics'].get('path', '')}   "
                                f"{st['metrics'].get('scrapes', 0)} scrapes")
    if (dash := st.get("dashboard") or {}).get("url"):
        head.add_row("dashboard", f"{dash['url']}{'   (token required)' if dash.get('token') else ''}   "
                                  f"{dash.get('pages', 0)} pages and feeds served")
    parts = [Panel(head, title="peertrain daemon", box=box.ROUNDED, expand=False)]

    topo = st.get("topology") or {}
    nbrs = {n["peer_id"]: n for n in topo.get("neighbours", [])}
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for col in ("peer", "address", "state", "RTT", "in", "out", "seen"):
        table.add_column(col, justify="right" if col in ("RTT", "in", "out", "seen") else "left", no_wrap=True)
    if nbrs:
        table.add_column("MH weight", justify="right", no_wrap=True)  # W_ij; one-neighbour exchanges use 1/3
        table.add_column("Mbit/s", justify="right", no_wrap=True)
    for p in st["peers"]:
        state = Text(p["state"], style=STATE_STYLE.get(p["state"], ""))
        rtt = f"{p['rtt_ms']:.1f} ms" if p.get("rtt_ms") is not None else "-"
        seen = human_duration(p.get("last_seen_s")) if p.get("last_seen_s") is not None else "-"
        address = f"via relay {p['via'][:8]}" if p.get("via") else p["address"] + (" (punched)" if p.get("path") == "punched" else "")
        row = [p["peer_id"][:8], address, state, rtt, human_bytes(p["bytes_in"]), human_bytes(p["bytes_out"]), seen]
        if nbrs:
            n = nbrs.get(p["peer_id"])
            row += [f"{n['weight']:.3f}" if n else "", _mbit(n) if n and n.get("bandwidth_bps") else ""]
        table.add_row(*row)
    parts.append(table)

    if st.get("nat"):
        parts.append(render_nat(st["nat"], st.get("bootstrap") or []))

    if topo:
        t = _facts()
        t.add_row("topology", f"{topo.get('kind')}   degree {topo.get('degree')}   view {topo.get('view_nodes')} peers / {topo.get('view_edges')} edges")
        t.add_row("spectral gap", f"{topo.get('spectral_gap', 0):.3f}")
        if topo.get("view_mode"):  # [membership] views: full, partial, or auto and which of them runs
            t.add_row("views", topo["view_mode"])
        if topo.get("last_move"):
            t.add_row("last move", topo["last_move"])
        if topo.get("views"):  # [membership] views = "partial"
            v = topo["views"]
            t.add_row("partial view", f"{v['degree']} active, {v['passive']} passive, {v['state_bytes']} bytes; "
                                      f"view messages {human_bytes(v['sent_bytes'])} out, {human_bytes(v['received_bytes'])} in")
            reading = (v.get("gap") or {}).get("reading")
            if reading:
                t.add_row("local gap", f"{reading['gap']:.4f}, {reading['ratio']:.2f}x a random "
                                       f"{reading['degree']:.1f}-regular graph's (epoch {reading['epoch']})")
        parts.append(Panel(t, title="topology", box=box.ROUNDED, expand=False))

    bans = st.get("bans") or []
    if bans:
        t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, title="banned from averaging")
        for col in ("peer", "for", "reason"):
            t.add_column(col, no_wrap=col != "reason")
        for b in bans:
            t.add_row(b["peer"][:8], human_duration(max(0.0, b["until"] - time.time())), b["reason"])
        parts.append(t)
    g = st.get("gossip") or {}
    if g.get("by_peer"):
        parts.append(render_partners(g["by_peer"]))
    if g.get("clipped") or g.get("struck") or g.get("lapsed"):
        t = _facts()
        for key, label in (("clipped", "clipped updates"), ("struck", "struck for distance"),
                           ("lapsed", "lapsed exchanges")):
            if g.get(key):
                t.add_row(label, "   ".join(f"{p[:8]} {n}" for p, n in sorted(g[key].items())))
        parts.append(Panel(t, title="averaging trouble", box=box.ROUNDED, expand=False))

    clients = (st.get("attach") or {}).get("clients") or []
    if clients:  # training processes attached to this daemon (peertrain.attach)
        t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, title="attached processes")
        for col in ("pid", "label", "groups", "since"):
            t.add_column(col)
        for c in clients:
            groups = "  ".join(f"{n} {b / 2**20:.1f} MiB" for n, b in c.get("groups", {}).items())
            t.add_row(str(c.get("pid")), c.get("label") or "-", groups or "-",
                      human_duration(max(0.0, time.time() - c.get("since", time.time()))))
        parts.append(t)

    tr = st.get("trainer")
    failure = trainer_failure(tr)
    if failure is not None:  # first, in red: nothing else on the screen explains why training stands still
        parts.append(Panel(Text(failure, style="bold red"), border_style="red", box=box.ROUNDED, expand=False,
                           title="trainer failed (its traceback is in the daemon's log)"))
    if st.get("pipeline"):
        parts.append(render_pipeline(st["pipeline"], tr))
    elif tr:
        t = _facts()
        t.add_row("job", "  ".join([str(tr.get("trainer"))] + [f"{k} {tr[k]}" for k in ("mode", "model", "device")
                                                              if tr.get(k) is not None]))
        state = Text("failed", style="bold red") if failure is not None else Text(tr.get("state", ""))
        t.add_row("progress", Text(f"step {tr.get('step')}   epoch {tr.get('epoch') or 0:.2f}   "
                                   f"{tr.get('samples_per_s') or 0:.0f} samples/s   ").append_text(state))
        loss = tr.get("loss")
        t.add_row("loss", (f"{loss:.4f}  " if loss is not None else "-  ") + sparkline(tr.get("loss_history", [])))
        acc = tr.get("accuracy")
        t.add_row("held-out acc", f"{acc * 100:.2f}%" if acc is not None else "-")
        cd = tr.get("consensus_distance")
        t.add_row("consensus dist", f"{cd:.3e}" if cd is not None else "-")
        if tr.get("rounds") is not None:  # local steps (mode = "local"): outer rounds, and exchanges skipped as busy
            t.add_row("outer rounds", f"{tr['rounds']}   exchanges skipped {tr.get('rounds_skipped') or 0}")
        pushes = g.get("pushes") or {}
        if any(pushes.values()):  # outer_codec "sparse": every round's update to every partner
            cosine = pushes.get("cosine") or {}
            angle = f"  cosine min {cosine['min']:.2f} median {cosine['median']:.2f}" if cosine else ""
            t.add_row("sparse pushes", f"sent {pushes.get('sent', 0)}  not taken {pushes.get('not_taken', 0)}  "
                                       f"failed {pushes.get('failed', 0)}   taken {pushes.get('taken', 0)}  "
                                       f"clipped {pushes.get('clipped', 0)}  opposed {pushes.get('opposed', 0)}  "
                                       f"refused {pushes.get('refused', 0)}{angle}")
        parts.append(Panel(t, title="training", box=box.ROUNDED, expand=False))
    return Group(*parts)


def render_partners(by_peer: dict) -> Table:
    """Who we averaged with: exchanges, the share of the last ones clipped, and the last distance against the
    radius we announced for it (docs/design.md, "Robust averaging")."""
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, title="averaging partners")
    for col in ("peer", "exchanges", "clipped", "clip rate", "distance", "our radius"):
        t.add_column(col, justify="left" if col == "peer" else "right", no_wrap=True)
    for pid, e in sorted(by_peer.items()):
        rate = e.get("clip_rate")
        t.add_row(pid[:8], str(e.get("exchanges", 0)), str(e.get("clipped", 0)),
                  f"{rate * 100:.0f}%" if rate is not None else "-", _sci(e.get("distance")),
                  _sci(e.get("radius")) if e.get("distance") is not None else "-")
    return t


def _sci(x: float | None) -> str:
    """A distance or radius: 3 significant digits; None (none announced, or not yet measured) as "-"."""
    return f"{x:.3g}" if x is not None else "-"


def render_nat(nat: dict, bootstrap: list[dict]):
    """Reachability and relaying: what `peer doctor` explains at length, in a few lines."""
    t = _facts()
    t.add_row("reachable", escape(f"{nat.get('reachability')}: {nat.get('reason', '')}"))
    mapping = nat.get("nat_mapping")
    if mapping and mapping != "unknown":
        t.add_row("NAT", {"none": "none (peers see our own address)", "preserving": "keeps ports (hole punching works)",
                          "random": "new port per destination (hole punching cannot work)"}.get(mapping, mapping))
    t.add_row("advertised", "  ".join(nat.get("advertised") or []) or "-")
    if nat.get("relays"):
        t.add_row("relays", "  ".join(f"{r['peer_id'][:8]} ({r['address']})" for r in nat["relays"]))
    srv = nat.get("relay_server") or {}
    if srv.get("offering") or srv.get("circuits_total"):
        t.add_row("relaying", f"{srv.get('reservations', 0)} reservations, {srv.get('circuits', 0)} circuits now "
                              f"({srv.get('circuits_total', 0)} in all), {human_bytes(srv.get('bytes_relayed', 0))} relayed")
    punches = nat.get("punches") or {}
    if punches.get("attempts"):
        t.add_row("hole punches", f"{punches.get('succeeded', 0)} of {punches['attempts']} succeeded")
    for b in bootstrap:
        if b.get("state") == "failing":
            t.add_row("bootstrap", escape(f"{b.get('cause', '')}; try: {b.get('fix', '')}"))
    return Panel(t, title="internet", box=box.ROUNDED, expand=False)


def render_local_summary(rows: list[dict]):
    """One row per daemon of a local swarm; with a pipeline running, each node's stage and pipeline figures
    (and the stage map as one line under the table) instead of gossip training's step and accuracy, and no
    listen address, so a row still fits a terminal. Under the table, in red, each failed trainer's cause."""
    pipeline = any((r.get("status") or {}).get("pipeline") for r in rows)
    if pipeline:
        table = Table(title="local swarm", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                      caption=stage_summary(rows), caption_justify="left")
        cols = ("node", "peer", "conn", "up", *SUMMARY_COLUMNS)
    else:
        table = Table(title="local swarm", box=box.SIMPLE_HEAD)
        cols = ("node", "peer", "listen", "state", "connected", "uptime", "step", "loss", "acc")
    for col in cols:
        table.add_column(col, no_wrap=pipeline and col != cols[-1])
    for r in rows:
        st = r.get("status")
        if st is None:
            error = Text(r.get("error", "down"), style="red")
            down = [r["node"], error] if pipeline else [r["node"], "-", "-", error]
            table.add_row(*down, *["-"] * (len(cols) - len(down)))
            continue
        tr = st.get("trainer") or {}
        conn, up = f"{st['connected']}/{len(st['peers'])}", human_duration(st["uptime_s"])
        if pipeline:
            table.add_row(r["node"], st["peer_id"][:8], conn, up, *summary_cells(st))
            continue
        failed = trainer_failure(tr) is not None
        state = Text("failed", style="bold red") if failed else Text("running", style="green")
        table.add_row(r["node"], st["peer_id"][:12], st["listen"], state, conn, up,
                      str(tr.get("step", "-")),
                      f"{tr['loss']:.3f}" if tr.get("loss") is not None else "-",
                      f"{tr['accuracy'] * 100:.1f}%" if tr.get("accuracy") is not None else "-")
    failures = [(r["node"], trainer_failure((r.get("status") or {}).get("trainer"))) for r in rows]
    failures = [(node, cause) for node, cause in failures if cause is not None]
    if not failures:
        return table
    lines = Text()
    for node, cause in failures:
        lines.append(f"{node} trainer failed: ", style="bold red").append(f"{cause}\n", style="red")
    return Group(table, lines)


def render_topology(topo: dict):
    """The whole known gossip graph: one row per peer with its neighbours, plus the spectral gap."""
    me = topo["me"]
    adj: dict[str, list[str]] = {n: [] for n in topo["nodes"]}
    for a, b in topo["edges"]:
        adj.setdefault(a, []).append(b)
        adj.setdefault(b, []).append(a)
    speed = {frozenset((l["a"], l["b"])): l for l in topo.get("links", [])}
    table = Table(title=f"gossip graph: {len(topo['nodes'])} peers, {len(topo['edges'])} edges, "
                        f"spectral gap {topo['spectral_gap']:.3f}", box=box.SIMPLE_HEAD)
    table.add_column("peer", no_wrap=True)
    table.add_column("degree", justify="right")
    table.add_column("neighbours (Mbit/s, RTT ms)")
    for node in sorted(adj):
        parts = []
        for nb in sorted(adj[node]):
            link = speed.get(frozenset((node, nb)), {})
            bw = f"{link['bandwidth_bps'] / 1e6:.0f}" if link.get("bandwidth_bps") else "?"
            rtt = f"{link['rtt_s'] * 1000:.1f}" if link.get("rtt_s") else "?"
            parts.append(f"{nb[:8]} ({bw}, {rtt})")
        name = Text(node[:8] + (" (me)" if node == me else ""), style="bold" if node == me else "")
        table.add_row(name, str(len(adj[node])), ", ".join(parts))
    return table
