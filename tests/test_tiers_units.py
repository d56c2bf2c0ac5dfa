"""The unit tier's guard (tests/conftest.py) refuses processes and sockets and lets socketpairs through; the
fast profile's ceiling holds tests' own example counts. A guard of its own runs inside the test's guard, so
what it refuses never reaches the one this test runs under."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import FAST_EXAMPLES, UnitTierViolation, cap_examples

REFUSED = pytest.fail.Exception


def test_this_module_is_in_the_unit_tier(request):
    assert request.node.get_closest_marker("unit")


@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6, socket.AF_UNIX])
def test_a_new_socket_of_any_family_is_refused(family):
    guard = UnitTierViolation()
    with guard.active(), pytest.raises(REFUSED, match=f"unit tier: opening a socket \\(family {family.name}\\)"):
        socket.socket(family, socket.SOCK_STREAM)
    assert len(guard.refused) == 1


def test_trio_tcp_is_refused_and_socketpairs_pass():
    guard = UnitTierViolation()

    async def main():
        a, b = trio.socket.socketpair()
        with a, b:
            await a.send(b"x")
            assert await b.recv(1) == b"x"
        with pytest.raises(BaseException):  # trio's happy eyeballs nursery wraps it in a group
            await trio.open_tcp_stream("127.0.0.1", 9)

    with guard.active():
        x, y = socket.socketpair()
        x.close(), y.close()
        trio.run(main)
    assert len(guard.refused) == 1 and "opening a socket (family AF_INET)" in guard.refused[0]


def test_processes_are_refused_before_they_start():
    guard = UnitTierViolation()
    before = {name: getattr(os, name) for name in ("fork", "system", "posix_spawn")}
    with guard.active():
        with pytest.raises(REFUSED, match="unit tier: starting a process"):
            subprocess.run([sys.executable, "-c", "pass"])
        for name, was in before.items():
            assert getattr(os, name) is not was and getattr(os, name).__name__ == name  # replaced; not called
    assert all(getattr(os, name) is was for name, was in before.items())  # and put back


def test_a_refusal_swallowed_in_a_thread_still_fails_the_test():
    guard = UnitTierViolation()

    def dial():
        try:
            socket.create_connection(("127.0.0.1", 9))
        except BaseException:  # what a careless worker thread does
            pass

    with guard.active():
        t = threading.Thread(target=dial)
        t.start()
        t.join()
    with pytest.raises(REFUSED, match="unit tier: opening a socket"):
        guard.check()


def test_the_fast_ceiling_holds_a_tests_own_example_count():
    @settings(max_examples=400, deadline=None)
    @given(st.integers())
    def prop(x):
        pass

    @settings(max_examples=3)
    @given(st.integers())
    def few(x):
        pass

    for test in (prop, few):
        cap_examples(SimpleNamespace(function=test))
    assert prop._hypothesis_internal_use_settings.max_examples == FAST_EXAMPLES
    assert prop._hypothesis_internal_use_settings.deadline is None  # the rest of the test's own settings stay
    assert few._hypothesis_internal_use_settings.max_examples == 3
