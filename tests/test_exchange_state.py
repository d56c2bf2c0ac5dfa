"""The averaging exchange's state machine (peer/averaging/exchange.py): the legal paths, illegal steps,
and what each way of ending leaves for the engine to clean up."""

from __future__ import annotations

import pytest

from peer.averaging.exchange import (
    ABORT, ABORT_AND_DISCARD, DISCARD, NOTHING, TRANSITIONS, Event, Exchange, ExchangeStateError, Role, State)

I, J = Role.INITIATOR, Role.SERVER


def run(role: Role, *events: Event) -> Exchange:
    x = Exchange(role)
    for event in events:
        x.handle(event)
    return x


def test_the_legal_paths_to_a_commit():
    i = Exchange(I)
    assert i.state is State.RESERVED and not i.ended
    assert [i.handle(e) for e in (Event.OFFER, Event.ACCEPT, Event.RECEIVED, Event.COMMIT)] == [
        State.OFFERED, State.TRANSFER, State.DECIDING, State.COMMITTED]
    assert i.committed and i.ended and i.cleanup == NOTHING
    j = Exchange(J)
    assert j.state is State.OFFERED
    assert [j.handle(e) for e in (Event.ACCEPT, Event.RECEIVED, Event.COMMIT)] == [
        State.TRANSFER, State.DECIDING, State.COMMITTED]
    assert j.committed and j.cleanup == NOTHING


@pytest.mark.parametrize("role, events, illegal", [
    (I, (), Event.ACCEPT),  # no accept before the offer went out
    (I, (Event.OFFER,), Event.COMMIT),  # no commit before their tensors are in
    (I, (Event.OFFER,), Event.ABORT),  # an initiator sends aborts, it does not take them
    (I, (Event.OFFER, Event.ACCEPT), Event.REFUSE),
    (J, (), Event.OFFER),  # a server starts with the offer taken
    (J, (), Event.COMMIT),  # a verdict is taken only once all of theirs is in
    (J, (Event.ACCEPT,), Event.ABORT),  # (an abort during the transfer waits for it to end)
    (I, (Event.OFFER, Event.REFUSE), Event.FAIL),  # nothing follows an ending
    (J, (Event.ACCEPT, Event.RECEIVED, Event.COMMIT), Event.ABORT),
])
def test_an_illegal_step_raises_and_changes_nothing(role, events, illegal):
    x = run(role, *events)
    before = (x.state, x.cleanup)
    with pytest.raises(ExchangeStateError, match=f"cannot take '{illegal.value}'"):
        x.handle(illegal)
    assert (x.state, x.cleanup) == before


@pytest.mark.parametrize("role, events, state, owed", [
    # initiator: an abort is owed once the offer is out and until the commit is; their tensors, once accepted
    (I, (), State.FAILED, NOTHING),  # nothing went out (a failed snapshot, a lost collision)
    (I, (Event.OFFER,), State.FAILED, ABORT),  # they may have accepted: call it off
    (I, (Event.OFFER, Event.REFUSE), State.REFUSED, NOTHING),
    (I, (Event.OFFER, Event.ACCEPT), State.FAILED, ABORT_AND_DISCARD),  # inconsistent accept, deadline
    (I, (Event.OFFER, Event.ACCEPT, Event.RECEIVED), State.FAILED, ABORT),  # the commit did not go out
    (I, (Event.OFFER, Event.ACCEPT, Event.RECEIVED, Event.COMMIT), State.COMMITTED, NOTHING),
    # server: the initiator's tensors are dropped unless all of them are in
    (J, (Event.REFUSE,), State.REFUSED, DISCARD),
    (J, (Event.ABORT,), State.ABORTED, DISCARD),  # aborted before we accepted: we send nothing
    (J, (), State.FAILED, DISCARD),
    (J, (Event.ACCEPT,), State.FAILED, DISCARD),
    (J, (Event.ACCEPT, Event.RECEIVED), State.FAILED, NOTHING),  # no verdict before the deadline
    (J, (Event.ACCEPT, Event.RECEIVED, Event.ABORT), State.ABORTED, NOTHING),
    (J, (Event.ACCEPT, Event.RECEIVED, Event.COMMIT), State.COMMITTED, NOTHING),
])
def test_what_each_ending_leaves_to_clean_up(role, events, state, owed):
    x = run(role, *events)
    cleanup = x.end("deadline passed")  # what the engine's finally does, whatever happened before
    assert (x.state, cleanup) == (state, owed)
    assert x.reason == ("deadline passed" if state is State.FAILED else "")
    assert x.end("later") is cleanup and x.state is state  # ending twice changes nothing


def test_the_reason_an_exchange_failed_is_kept_for_its_abort():
    x = run(I, Event.OFFER, Event.ACCEPT)
    x.handle(Event.FAIL, "inconsistent accept (weight 0.5, offered at most 0.3)")
    assert x.end("cancelled").send_abort and x.reason.startswith("inconsistent accept")


def test_every_open_state_can_fail_and_no_ending_goes_on():
    """So `end` never raises, and nothing happens to an exchange after it ended."""
    for role, table in TRANSITIONS.items():
        for state, steps in table.items():
            assert Event.FAIL in steps, (role, state)
            for end, cleanup in steps.values():
                assert (end not in table) == (cleanup is not None), (role, state, end)
