"""The suite's tiers, their guard, hypothesis profiles, and the `cluster` fixture.

Three tiers, so the everyday loop runs in well under a minute and the whole suite in parallel:

- **unit** (`./dev test --fast`, `pytest -m unit`): the modules in `UNIT_MODULES`, less their tests marked
  `slow` or `process`. A unit test starts no process and opens no socket other than a `socket.socketpair`
  (trio memory streams and `trio.testing.MockClock(autojump_threshold=0)` stand in for the network and the
  clock). This is enforced, not promised: while a unit test runs (setup, call, teardown) starting a
  process or opening a socket fails it, so a test that starts a daemon cannot sneak into the tier.
- **serial** (`-m serial`): tests whose timings do not survive a second test on the same cores, or that
  build network namespaces (every `netns` test): `./dev test` runs them alone, after the rest.
- everything else: process tests (real daemons, sockets, subprocesses), run three at a time by `./dev test`.

Hypothesis has two profiles: `ci` (loaded unless another is asked for) and `fast` (`./dev test --fast`).
"""

from __future__ import annotations

import _posixsubprocess
import os
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from peer.testing import pace
from peer.testing.swarm import TEST_VIEWS_ENV, LocalSwarm

pytest_plugins = ["tests.cpu_budget"]  # CPU seconds by test, when PEERTRAIN_TEST_CPU names a folder

TESTS = Path(__file__).resolve().parent

# The unit tier, by module: each is pure (the protocol, codecs, config, topology maths, exchange state
# machine, bounds, pipeline rules, NAT message rules, attach wire...). A test in one of these that needs a
# process, a real socket or real seconds carries `@pytest.mark.process` or `@pytest.mark.slow` and leaves
# the tier; a new pure module is added here.
UNIT_MODULES = frozenset({
    "test_attach_units.py",
    "test_averaging_bounds.py",
    "test_averaging_pushes.py",
    "test_averaging_edge_copies.py",
    "test_averaging_shares.py",
    "test_averaging_sparse_updates.py",
    "test_bench_gossip.py",
    "test_bench_nat.py",
    "test_bench_pipeline.py",
    "test_bench_sybil.py",
    "test_bench_train.py",
    "test_bench_wan.py",
    "test_byzantine_units.py",
    "test_checkpoints.py",
    "test_config.py",
    "test_consensus_trainer.py",
    "test_docs.py",
    "test_doctor.py",
    "test_exchange_state.py",
    "test_fuzz_records.py",
    "test_fuzz_wire.py",
    "test_handshake_slots.py",
    "test_mdns.py",
    "test_memory_caps.py",
    "test_metrics_prometheus.py",
    "test_nat_units.py",
    "test_peer_store.py",
    "test_pipeline_demo.py",
    "test_pipeline_memory.py",
    "test_pipeline_once_units.py",
    "test_pipeline_reach_units.py",
    "test_pipeline_partition.py",
    "test_pipeline_rebalance.py",
    "test_pipeline_seating.py",
    "test_pipeline_reference.py",
    "test_pipeline_stage.py",
    "test_pipeline_state_units.py",
    "test_pipeline_units.py",
    "test_pipeline_verify_units.py",
    "test_protocol_cipher_frames.py",
    "test_protocol_handshake.py",
    "test_protocol_identity.py",
    "test_protocol_limits.py",
    "test_protocol_messages.py",
    "test_protocol_noise.py",
    "test_protocol_tensor_codec.py",
    "test_protocol_sparse_codec.py",
    "test_router.py",
    "test_topology_math.py",
    "test_topology_records.py",
    "test_topology_rewire.py",
    "test_topology_spectral.py",
    "test_topology_yardsticks.py",
    "test_torch_data.py",
    "test_trainer_failure.py",
    "test_trainer_host_units.py",
    "test_tiers_units.py",
    "test_trainers_models.py",
    "test_local_steps.py",
    "test_seams.py",
    "test_gossip_messages.py",
    "test_control_units.py",
    "test_topology_edges.py",
    "test_topology_record_book.py",
    "test_views.py",
    "test_auto_views_units.py",
    "test_topology_local.py",
    "test_heartbeat_units.py",
    "test_dashboard_units.py",
    "test_pace_units.py",
    "test_integrations_units.py",
})

# Whole modules in the serial tier: their tests measure rates or race timers that a second test on the same
# two cores would skew. A single test joins with `@pytest.mark.serial`; `netns` tests join by themselves.
SERIAL_MODULES = frozenset({
    "test_attack_liveness.py",  # an honest peer admitted within 2 s, a mute one dropped within dead_after + 5 s
    "test_attack_membership.py",  # a poisoned record refused within 1 s; dials counted over a 6 s window
    "test_attack_topology.py",  # a broadcast's median time under 1 s
})

# Modules whose tests take the longest (a minute or more each on the 2-core VM, `--durations` of 2026-11-28):
# they are handed out first, so the parallel tier does not end with one worker alone on a two-minute test.
LONG_MODULES = frozenset({
    "test_pipeline_swarm.py",
    "test_bench_pipeline.py",
    "test_bench_train.py",
    "test_pipeline_rebalance_swarm.py",
    "test_bench_attach.py",
    "test_local_steps.py",
    "test_pipeline_verify_swarm.py",
    "test_partial_views.py",
    "test_byzantine.py",
    "test_pipeline_demo.py",
    "test_pipeline_partial_views.py",
    "test_integrations_examples.py",
})

# The fast profile's examples per property test, and a ceiling on the counts tests set themselves
# (`@settings(max_examples=400)` would otherwise beat any profile): enough to run every strategy's edge
# cases on each run, few enough that the unit tier stays under a minute. `ci` keeps each test's own count.
FAST_EXAMPLES = 10

# Deadlines are off in both: a 2-core machine running tests two at a time stalls any example past 200 ms
# now and then, which says nothing about the code. too_slow is suppressed for the same reason.
settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile("fast", settings.get_profile("ci"), max_examples=FAST_EXAMPLES)
settings.load_profile("ci")  # `--hypothesis-profile fast` (./dev test --fast) loads the other one later


# One CPU thread per torch (and OpenMP/MKL) in every test process and every process a test starts. The suite
# runs three workers and their daemons on two cores: intra-op threads there only contend, and OpenMP's
# spinning threads under oversubscription turned a 2 s test into a 100 s one (2026-11-28). Trainers already
# default to one thread ([trainer] threads); a test that wants more sets it.
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
for _name, _value in THREAD_ENV.items():
    os.environ.setdefault(_name, _value)


def pytest_configure(config: pytest.Config) -> None:
    # the machine's slowdown against the one the bounds were sized on, measured once in the controlling process
    # (xdist's workers and the tests' daemons inherit it): peer/testing/pace.py
    if pace.SLOWDOWN_ENV not in os.environ:
        os.environ[pace.SLOWDOWN_ENV] = f"{pace.measure():.2f}"
    import torch

    torch.set_num_threads(1)
    missing = sorted(m for m in UNIT_MODULES | SERIAL_MODULES | LONG_MODULES if not (TESTS / m).is_file())
    if missing:  # a renamed file would otherwise leave its tier without a word
        raise pytest.UsageError(f"tests/conftest.py names test modules that do not exist: {', '.join(missing)}")


def in_unit_tier(item: pytest.Item) -> bool:
    if item.get_closest_marker("unit"):
        return True
    return (item.path.name in UNIT_MODULES
            and not any(item.get_closest_marker(m) for m in ("slow", "process", "netns", "serial")))


def pytest_report_header(config: pytest.Config) -> str:
    return f"peertrain: time bounds scaled x{pace.slowdown():g} for this machine ({pace.SLOWDOWN_ENV})"


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the markers set here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    fast = settings.get_current_profile_name() == "fast"
    scale_timeouts(config, items)
    items.sort(key=lambda item: item.path.name not in LONG_MODULES)  # stable: the long ones first, else in order
    for item in items:
        if in_unit_tier(item):
            item.add_marker("unit")
        if item.get_closest_marker("netns") or item.path.name in SERIAL_MODULES:
            item.add_marker("serial")
        if fast:
            cap_examples(item)
        full_view = item.get_closest_marker("full_view")
        if full_view is not None and os.environ.get(TEST_VIEWS_ENV) == "partial":
            item.add_marker(pytest.mark.skip(reason=f"full views only: {full_view.args[0]}"))


def scale_timeouts(config: pytest.Config, items: list[pytest.Item]) -> None:
    """pytest-timeout's limit per test (pyproject's `timeout`, or a test's own marker), scaled to this machine."""
    default = float(config.getini("timeout") or 0)
    for item in items:
        own = item.get_closest_marker("timeout")
        limit = float(own.args[0]) if own is not None and own.args else default
        if limit > 0:
            # first: pytest-timeout reads the closest marker, and a test's own one would be found before an appended one
            item.add_marker(pytest.mark.timeout(pace.scaled(limit)), append=False)


def cap_examples(item: pytest.Item) -> None:
    """Hold a property test's own `max_examples` to the fast profile's: hypothesis lets a test's
    `@settings` beat the loaded profile, and keeps the merged settings on the test function."""
    test = getattr(item, "function", None)
    own = getattr(test, "_hypothesis_internal_use_settings", None)
    if own is not None and own.max_examples > FAST_EXAMPLES:
        test._hypothesis_internal_use_settings = settings(own, max_examples=FAST_EXAMPLES)


class UnitTierViolation:
    """Refuses processes and sockets while a unit test runs; remembers each refusal, so that one made in a
    thread, or caught by the code under test, still fails the test."""

    HINT = ("a unit test starts no process and opens no socket but a socket.socketpair (use trio memory "
            "streams and trio.testing.MockClock): move it out of the unit tier with @pytest.mark.process, "
            "or out of UNIT_MODULES in tests/conftest.py")

    def __init__(self) -> None:
        self.refused: list[str] = []

    def refuse(self, what: str) -> None:
        message = f"unit tier: {what} refused; {self.HINT}"
        self.refused.append(message)
        pytest.fail(message, pytrace=False)

    @contextmanager
    def active(self) -> Iterator[UnitTierViolation]:
        def blocked(owner: object, name: str, what: str):
            def refused(*args, **kwargs):
                self.refuse(what)
            # named as what it replaces, so a pickle that names os.system (a malicious checkpoint's test data)
            # still finds it where pickle looks
            refused.__module__, refused.__name__, refused.__qualname__ = owner.__name__, name, name
            return refused

        real_socket_init = socket.socket.__init__

        def socket_init(sock, family=-1, type=-1, proto=-1, fileno=None):
            if fileno is None:  # a new socket; socketpair() and fromfd() wrap descriptors they already hold
                self.refuse(f"opening a socket (family {socket.AddressFamily(family).name if family != -1 else 'AF_INET'})")
            real_socket_init(sock, family, type, proto, fileno)

        patches = [(subprocess.Popen, "_execute_child", lambda *a, **k: self.refuse("starting a process (subprocess)")),
                   (_posixsubprocess, "fork_exec", blocked(_posixsubprocess, "fork_exec", "starting a process")),
                   (socket.socket, "__init__", socket_init)]
        patches += [(os, name, blocked(os, name, f"os.{name}")) for name in
                    ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp") if hasattr(os, name)]
        saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
        for owner, name, replacement in patches:
            setattr(owner, name, replacement)
        try:
            yield self
        finally:
            for owner, name, original in saved:
                setattr(owner, name, original)

    def check(self) -> None:
        if self.refused:
            pytest.fail("\n".join(self.refused), pytrace=False)


def guarded(item: pytest.Item):
    """One phase of a test (setup, call, teardown), under the guard when the test is in the unit tier."""
    if not item.get_closest_marker("unit"):
        return (yield)
    guard = UnitTierViolation()
    with guard.active():
        result = yield
    guard.check()
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    return (yield from guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    return (yield from guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    return (yield from guarded(item))


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


@pytest.fixture
def cluster(tmp_path, request):
    """Real daemons for one test (`cluster.start(name, *args, config=...)`); their logs are printed if the
    test fails, and they are always stopped."""
    swarm = LocalSwarm(tmp_path)
    yield swarm
    failed = getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed
    if failed:
        swarm.dump_logs()
    swarm.stop()
