"""Rendering the swarm pipeline's part of `peer status` (the "pipeline" section of `--json`) for people.

The stage map is what a user watches: which peers serve each stage, how fast and how busy each is, how far
each one's stage has trained (its optimizer step), which ones are moving to another stage (rebalancing),
which ones this driver avoids after failures, each stage's capacity and the bottleneck (the stage that bounds
the whole pipeline's throughput). Below it, what this peer does as a driver (microbatches and their
accounting), as a server (calls served, refused and handed back after a move), and its moves: the last ones
(when, where, why, how long, where the stage's state came from), the stage copies it keeps and the stage
states it sent and fetched.
"""

from __future__ import annotations

import time

from rich import box
from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

SHOWN_FAILURES = 3  # recent failed microbatches printed with their reasons (`--json` has up to 20)
NOTE_CHARS = 48  # an avoided peer's reason is cut here so the stage map stays one line a peer (`--json` has it all)
SHOWN_MOVES = 5  # this peer's latest moves listed, newest first (`--json` has the last 10)
REASON_CHARS = 72  # a move's reason is cut here so each move stays one line (`--json` has it all)


def _facts() -> Table:
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    return t


def _num(v, fmt: str = "{:.4f}") -> str:
    return "-" if v is None else fmt.format(v)


def _cut(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n - 1] + "…"


def _ago(seconds: float) -> str:
    """A duration the way `peer status` prints uptimes: 42s, 3m05s, 2h07m."""
    s = max(0.0, float(seconds))
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{s // 60:.0f}m{s % 60:02.0f}s"
    return f"{s // 3600:.0f}h{(s % 3600) // 60:02.0f}m"


def stage_map_table(pl: dict) -> Table:
    """One row per peer of each stage; the stage's number and capacity on its first row, the bottleneck marked."""
    bottleneck = pl.get("bottleneck")
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for col, right in (("stage", False), ("capacity/s", True), ("peer", False), ("samples/s", True),
                       ("step", True), ("queue", True), ("memory MiB", True), ("", False)):
        t.add_column(col, justify="right" if right else "left", no_wrap=col != "")
    for entry in pl.get("stage_map", []):
        s = entry["stage"]
        mark = s == bottleneck
        label = Text(f"{s}" + (" ◀ bottleneck" if mark else ""), style="bold red" if mark else "bold")
        cap = f"{entry['capacity']:.0f}"
        peers = entry.get("peers", [])
        if not peers:
            t.add_row(label, cap, Text("no live peer", style="red"), "-", "-", "-", "-", "")
            continue
        for i, p in enumerate(peers):
            name = Text(p["peer_id"][:8] + (" (me)" if p.get("me") else ""), style="bold" if p.get("me") else "")
            speed = f"{p['samples_per_s']:.0f}" if p.get("samples_per_s") else "not measured"
            note = Text()
            moving_to = p.get("moving_to")
            if moving_to is not None and moving_to >= 0:
                note.append(f"-> stage {moving_to}", style="cyan")
            avoided = p.get("avoided") or ""
            if avoided:
                note.append(("   " if note else "") + _cut(avoided, NOTE_CHARS), style="yellow")
            mem = f"{p['memory_used_mib']}/{p['memory_mib']}" if p.get("memory_mib") else "-"  # used / budget
            t.add_row(label if i == 0 else "", cap if i == 0 else "", name, speed, _num(p.get("step"), "{}"),
                      str(p.get("queue", 0)), mem, note)
    return t


def _driver_facts(d: dict, tr: dict, reach: dict | None = None) -> Table:
    t = _facts()
    t.add_row("microbatches", f"{d.get('done', 0)} done   {d.get('retried', 0)} retried ({d.get('resent', 0)} calls "
                              f"re-sent)   {d.get('failed', 0)} failed   {d.get('in_flight', 0)} in flight")
    if reach:  # partial views: servers we had no session with, dialed at their announcement's addresses
        t.add_row("lookups", f"{reach.get('dialed_servers', 0)} servers reached   {reach.get('pending', 0)} pending   "
                             f"{reach.get('failed', 0)} failed   {reach.get('busy', 0)} busy")
    waiting = d.get("waiting") or []
    if waiting:
        t.add_row("waiting", Text("   ".join(f"for stage {w['stage']} ({w['for_s']:.0f}s)" for w in waiting),
                                  style="yellow"))
    loss = tr.get("loss") if tr.get("loss") is not None else d.get("loss")
    t.add_row("loss", f"{_num(loss)}   val loss {_num(tr.get('val_loss'))}"
                      + (f"   ({tr['val_error']})" if tr.get("val_error") else ""))
    if tr.get("samples_per_s") is not None:
        t.add_row("throughput", f"{tr['samples_per_s']:.1f} samples/s driven   {tr.get('samples', d.get('samples', 0))} "
                                f"samples   call deadline ~{_num(d.get('deadline_s'), '{:.1f}')}s")
    if d.get("acked_samples"):
        t.add_row("gradients", f"samples taken by stage {d['acked_samples']}   {d.get('dropped', 0)} dropped (failed "
                               f"microbatches)   {d.get('ack_lost', 0)} acks lost")
    if d.get("struck"):  # servers that refused or failed calls another peer of their stage served
        t.add_row("struck", Text("   ".join(f"{p[:8]} x{n}" for p, n in d["struck"].items()), style="yellow"))
    for f in (d.get("failures") or [])[-SHOWN_FAILURES:]:
        t.add_row("failed", Text(f"microbatch {f['microbatch']}: {f['reason']}", style="red"))
    return t


def _server_facts(sv: dict, pl: dict, tr: dict) -> Table:
    t = _facts()
    refused = sv.get("refused") or {}
    ref = ", ".join(f"{code} {n}" for code, n in sorted(refused.items())) or "0"
    back = f"handed back {sv['handed_back']}   " if sv.get("handed_back") is not None else ""
    t.add_row("served", f"{sv.get('served', 0)} calls   refused {ref}   failed {sv.get('failed', 0)}   {back}"
                        f"queue {sv.get('queue', 0)}   compute {sv.get('compute_s', 0):.1f}s")
    if sv.get("accumulated_samples") is not None:
        dropped = ", ".join(f"{why} {n}" for why, n in sorted((sv.get("dropped") or {}).items())) or "0"
        t.add_row("gradients", f"{sv['accumulated_samples']} samples taken once acknowledged   {sv.get('kept', 0)} "
                               f"kept ({_num(sv.get('kept_mb'), '{:.1f}')} MB) awaiting an ack   dropped {dropped}")
    if tr.get("stage_steps") is not None:
        t.add_row("stage", f"{pl.get('my_stage')}: {tr['stage_steps']} optimizer steps, {tr.get('stage_samples', 0)} "
                           f"samples, {tr.get('stage_samples_per_s', 0):.0f} samples/s of compute")
    mem = pl.get("memory") or {}
    if mem.get("budget_mib"):
        t.add_row("memory", Text(f"{mem.get('used_mib', 0)} MiB used of a {mem['budget_mib']} MiB budget "
                                 f"({mem.get('source')}); a stage may use {mem.get('stage_room_mib', 0)} MiB"
                                 + (f"   model {tr['model_mib']} MiB in all" if tr.get("model_mib") else "")))
    if sv.get("last_error"):
        t.add_row("last error", Text(sv["last_error"], style="red"))
    return t


def moves_table(moves: list[dict], now: float) -> Table:
    """This peer's latest moves, newest first: when, from -> to, how long it took, where the stage's state came
    from, the samples of gradient the move dropped, and why (cut)."""
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for col, right in (("ago", True), ("move", False), ("took", True), ("state from", False), ("dropped", True),
                       ("reason", False)):
        t.add_column(col, justify="right" if right else "left", no_wrap=col != "reason")
    for m in list(reversed(moves))[:SHOWN_MOVES]:
        kind = "live" if m.get("live") else "copy"
        state = f"{m.get('source', '-')}: step {_num(m.get('step'), '{}')}"
        if m.get("source") not in ("own copy", "none (restarted)"):
            state += f" {kind}"
        if m.get("mb"):
            state += f", {m['mb']:.1f} MB in {_num(m.get('download_s'), '{:.1f}')}s"
        t.add_row(_ago(now - m["at"]) if m.get("at") is not None else "-", f"{m.get('from')} -> {m.get('to')}",
                  f"{_num(m.get('took_s'), '{:.1f}')}s", state, str(m.get("dropped_samples", 0)),
                  _cut(m.get("reason") or "", REASON_CHARS))
    return t


def _state_facts(pl: dict) -> Table:
    """The stage copies this peer keeps, and the stage states it sent and fetched."""
    t = _facts()
    tx = pl.get("state_transfers") or {}
    copies = sorted(tx.get("copies") or [], key=lambda c: c["stage"])
    t.add_row("copies", "   ".join(f"stage {c['stage']} step {c['step']} ({_ago(c.get('age_s', 0))} old)"
                                   for c in copies) or "none")
    refused = ", ".join(f"{code} {n}" for code, n in sorted((tx.get("refused") or {}).items())) or "0"
    t.add_row("states", f"{tx.get('served', 0)} sent   refused {refused}   {tx.get('uploads', 0)} sending   "
                        f"{tx.get('fetched', 0)} fetched   {tx.get('fetch_failed', 0)} fetches failed")
    if tx.get("last_error"):
        t.add_row("last error", Text(tx["last_error"], style="red"))
    return t


def render_pipeline(pl: dict, tr: dict | None = None, *, now: float | None = None) -> Panel:
    """The "pipeline" section of a daemon's status (and its trainer's metrics, for loss and val loss); `now`
    (time.time()) dates the moves."""
    tr = tr or {}
    head = _facts()
    me = pl.get("my_stage")
    moving = pl.get("moving_to")
    head.add_row("pipeline", f"{pl.get('pipeline')}   {pl.get('stages')} stages cut at blocks {pl.get('cuts')}   "
                             f"role {pl.get('role') or '-'}   my stage {'-' if me is None else me}"
                             + (f"   moving to stage {moving}" if moving is not None else "")
                             + ("   driving done" if tr.get("driving_done") else ""))
    seat = pl.get("seating") or {}
    if seat.get("order") or seat.get("cooling_from") is not None:  # the daemon's decision (peer/pipeline/seating.py)
        order = seat.get("order") or {}
        head.add_row("seating", (f"ordered to stage {order.get('to_stage')}: {order.get('reason')}" if order else "")
                     + (f"   stage {seat['cooling_from']} cooling down after our move"
                        if seat.get("cooling_from") is not None else ""))
    parts = [head, stage_map_table(pl)]
    if pl.get("driver"):
        parts.append(Panel(_driver_facts(pl["driver"], tr, pl.get("reach")), title="driver", box=box.ROUNDED,
                           expand=False))
    if pl.get("my_stage") is not None and pl.get("server"):
        parts.append(Panel(_server_facts(pl["server"], pl, tr), title="server", box=box.ROUNDED, expand=False))
    tx = pl.get("state_transfers") or {}
    if pl.get("moves") or tx.get("copies") or any(tx.get(k) for k in ("served", "refused", "fetched", "fetch_failed",
                                                                        "uploads", "last_error")):
        moves = pl.get("moves") or []
        body = [moves_table(moves, time.time() if now is None else now)] if moves else []
        parts.append(Panel(Group(*body, _state_facts(pl)), title="moves", box=box.ROUNDED, expand=False))
    return Panel(Group(*parts), title="pipeline", box=box.ROUNDED, expand=False)


SUMMARY_COLUMNS = ("stage", "served", "driven", "failed", "samples/s", "loss", "val loss", "trainer")


def summary_cells(st: dict) -> list[str]:
    """A daemon's pipeline figures for `peer local`'s table, one per SUMMARY_COLUMNS."""
    pl, tr = st.get("pipeline") or {}, st.get("trainer") or {}
    d, sv = pl.get("driver") or {}, pl.get("server") or {}
    stage = pl.get("my_stage", tr.get("my_stage"))
    mark = " ◀" if stage is not None and stage == pl.get("bottleneck") else ""
    state = "done" if tr.get("driving_done") else (tr.get("state") or "-")  # done driving; it still serves
    return ["-" if stage is None else f"{stage}{mark}", str(sv.get("served", "-")),
            str(d.get("done", tr.get("microbatches_done", "-"))), str(d.get("failed", tr.get("microbatches_failed", "-"))),
            _num(tr.get("samples_per_s"), "{:.1f}"), _num(tr.get("loss"), "{:.3f}"), _num(tr.get("val_loss"), "{:.3f}"),
            state]


def stage_summary(rows: list[dict]) -> str:
    """The stage map in one line, as the first live pipeline peer sees it: peers and capacity per stage."""
    for r in rows:
        pl = (r.get("status") or {}).get("pipeline")
        if pl and pl.get("stage_map"):
            stages = [f"{e['stage']}{'◀' if e['stage'] == pl.get('bottleneck') else ''}: {len(e['peers'])}p "
                      f"{e['capacity']:.0f}/s" for e in pl["stage_map"]]
            return f"stage map as {r['node']} sees it (p: peers, /s: capacity, ◀: bottleneck)   " + "   ".join(stages)
    return ""
