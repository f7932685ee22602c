"""Fixtures the test modules share."""
import pytest


@pytest.fixture(scope='module')
def one_blas_thread():
    """The module's products on one BLAS thread (threadpoolctl), for speed only: the independent
    references' forwards are a few dozen rows against each matrix, and on two busy cores BLAS's
    default pool waits on its slowest thread for each (SmolLM2's reference, seven prompts and 32
    greedy steps: 62 s of CPU on two threads with the machine at load 7, 9 s on one). A module asks
    for it with `pytestmark = pytest.mark.usefixtures('one_blas_thread')`."""
    from threadpoolctl import threadpool_limits
    with threadpool_limits(1, user_api='blas'):
        yield


def pytest_collection_finish(session):
    """Start the documentation site's build and the browser's visit of it in the background
    (`test_docs.start_site`) as soon as the session has collected a test that reads the site, so
    that they overlap the tests before it; the browser only for a test that reads what it saw."""
    if session.config.option.collectonly: return
    if hasattr(session.config, 'workerinput'): return  # an xdist worker: started on first use
    uses = {}
    for item in session.items:
        names = set(getattr(item, 'fixturenames', ()))
        if 'site' in names and hasattr(getattr(item, 'module', None), 'start_site'):
            uses[item.module] = uses.get(item.module, False) or bool(names & {'seen', 'server'})
    for module, browse in uses.items():
        module.start_site(browse)
