"""A failing trainer is loud: its one-line cause in `peer status` and `peer local status`, and `peer local
--demo` ends as soon as every trainer has failed or its timeout passes (`demo_end`, on synthetic rows here;
tests/test_local.py runs the real thing)."""

from __future__ import annotations

from rich.console import Console

from peer.cli.local import demo_end
from peer.cli.status_view import render_local_summary, render_status, trainer_failure
from peer.training_report import FAILURE_CHARS, failure_state


def row(node: str, trainer: dict | None, *, running: bool = True, answered: bool = True) -> dict:
    status = {"peer_id": f"{node}peerid0000000", "listen": "127.0.0.1:1", "connected": 1, "peers": [{}],
              "uptime_s": 3.0, "trainer": trainer} if answered else None
    return {"node": node, "home": f"/runs/{node}", "status": status, "running": running,
            **({} if answered else {"error": "no answer"})}


FAILED = {"trainer": "trainers.gossip_sgd", "state": "failed: ValueError: [trainer.options] loss: bad"}
TRAINING = {"trainer": "trainers.gossip_sgd", "state": "training", "step": 40, "accuracy": 0.5, "target_accuracy": 0.95}
DONE = {"trainer": "trainers.gossip_sgd", "state": "done", "step": 90, "accuracy": 0.96, "reached_target": True}


def text(renderable) -> str:
    console = Console(width=200, record=True)
    console.print(renderable)
    return console.export_text()


def test_failure_state_is_one_line_and_bounded():
    assert failure_state(ValueError("bad\nsecond line")) == "failed: ValueError: bad"
    wrapped = RuntimeError("Caught KeyError in DataLoader worker process 0.\nOriginal Traceback (most recent call "
                           "last):\n  File \"x.py\", line 1\nKeyError: 5")
    assert failure_state(wrapped) == "failed: RuntimeError: KeyError: 5"
    long = failure_state(ValueError("x" * 1000))
    assert len(long) == FAILURE_CHARS and long.endswith("…") and "\n" not in long
    assert failure_state(KeyError()) == "failed: KeyError"


def test_failed_trainer_shows_in_red_in_both_views():
    assert trainer_failure(FAILED) == "ValueError: [trainer.options] loss: bad"
    assert trainer_failure(TRAINING) is None and trainer_failure(None) is None
    summary = render_local_summary([row("node1", FAILED), row("node2", TRAINING)])
    out = text(summary)
    assert "node1 trainer failed: ValueError: [trainer.options] loss: bad" in out
    assert "failed" in out.splitlines()[[i for i, ln in enumerate(out.splitlines()) if "node1" in ln][0]]
    st = {"peer_id": "p", "swarm": "s", "protocol_version": 1, "version": "0", "listen": "l", "mdns": True,
          "ciphers": ["c"], "uptime_s": 1, "pid": 1, "home": "/h", "connected": 0, "peers": [], "trainer": FAILED}
    out = text(render_status(st))
    assert "trainer failed" in out and "[trainer.options] loss: bad" in out


def test_demo_ends_when_every_trainer_failed():
    end = demo_end([row("node1", FAILED), row("node2", FAILED)])
    assert end is not None and not end.ok and end.reason == "every trainer failed"
    cause = "ValueError: [trainer.options] loss: bad"
    assert [(n, c) for n, c, _ in end.failures] == [("node1", cause), ("node2", cause)]
    assert end.failures[0][2] == "/runs/node1/daemon.log"


def test_demo_waits_while_any_trainer_may_still_finish():
    assert demo_end([row("node1", FAILED), row("node2", TRAINING)]) is None
    assert demo_end([row("node1", FAILED), row("node2", None, answered=False)]) is None  # still starting
    end = demo_end([row("node1", FAILED), row("node2", DONE)])
    assert end is not None and not end.ok and end.reason == "1 of 2 trainers failed"
    end = demo_end([row("node1", FAILED), row("node2", None, answered=False, running=False)])  # crashed
    assert end is not None and not end.ok


def test_demo_timeout_without_the_target_is_a_failure():
    rows = [row("node1", TRAINING), row("node2", TRAINING)]
    assert demo_end(rows) is None
    end = demo_end(rows, timeout_s=30)
    assert end is not None and not end.ok and end.reason == "--timeout 30s passed before training finished"
    assert demo_end([row("node1", DONE), row("node2", DONE)], timeout_s=30).ok  # done wins over the clock


def test_demo_fails_when_every_daemon_exited():
    end = demo_end([row("node1", None, answered=False, running=False)])
    assert end is not None and not end.ok and "every daemon exited" in end.reason
