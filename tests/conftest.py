import pytest

from tests.daemons import Cluster


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


@pytest.fixture
def cluster(tmp_path, request):
    """Real daemons for one test; their logs are printed if the test fails."""
    c = Cluster(tmp_path)
    yield c
    failed = getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed
    if failed:
        c.dump_logs()
    c.close()
