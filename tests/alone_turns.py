"""``@pytest.mark.alone``: under pytest-xdist, a test that runs with no other test beside it.

``make test`` runs the suite on two xdist workers. A few tests measure the
machine (a latency ratio, a server's memory growth over a short window) and
would measure the other worker's load too; marked ``alone``, such a test waits
until the other workers finish their current test, and they start no new one
until it is done.

Two lock files in a folder the controller makes for the run, a turnstile:
every test passes through ``gate`` (taken and dropped at once) and runs holding
``run`` shared; an ``alone`` test holds ``gate`` for its whole run, so no new
test gets in, and takes ``run`` exclusively, so it starts once the ones
already running are done. The locks cover each test's whole protocol (setup,
call, teardown, module fixtures included); a worker's idle module fixtures
(a server waiting for requests) stay up beside it. Without xdist nothing
changes.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from radixmux.common.file_lock import held

LOCK_DIR_KEY = "radixmux_alone_dir"


class AloneTurns:
    """The plugin: registered by conftest.py; both sides of an xdist run."""

    def __init__(self) -> None:
        self.made: Path | None = None  # the controller's folder of locks

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node) -> None:
        """Controller: hand each worker the run's lock folder (made once)."""
        if self.made is None:
            self.made = Path(tempfile.mkdtemp(prefix="radixmux-alone-"))
        node.workerinput[LOCK_DIR_KEY] = str(self.made)

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        """Controller: remove the lock folder after the run."""
        if self.made is not None:
            shutil.rmtree(self.made, ignore_errors=True)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, object, object]:
        """Worker: run the test's whole protocol inside its turn."""
        workerinput = getattr(item.config, "workerinput", None)
        if workerinput is None or LOCK_DIR_KEY not in workerinput:
            return (yield)  # no xdist: every test runs alone anyway
        with _turn(Path(workerinput[LOCK_DIR_KEY]), item.get_closest_marker("alone") is not None):
            return (yield)


@contextlib.contextmanager
def _turn(folder: Path, alone: bool) -> Iterator[None]:
    gate, run = folder / "gate", folder / "run"
    if alone:
        with held(gate), held(run):
            yield
        return
    with held(gate):
        pass  # waits here while an alone test holds the gate
    with held(run, shared=True):
        yield
