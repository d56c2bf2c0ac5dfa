import pytest

from peer.testing.swarm import LocalSwarm


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
