"""A progress line every so often for a long run (``--progress=SECONDS``, which ``make test``
sets): the time, the tests done and failed, the files running, and the slowest tests so far —
so a run that is stopped, or printing ``-q`` dots for many minutes, still says where it is and
what took its time. Under pytest-xdist it runs in the controller, from the workers' reports."""
from __future__ import annotations

import time

import pytest

SLOWEST = 3     # tests named in each line


def addoption(parser) -> None:
    parser.addoption("--progress", type=float, default=0.0, metavar="SECONDS",
                     help="print a progress line at most every SECONDS (0: never): tests done, "
                          "files running, the slowest tests so far")


class Progress:
    def __init__(self, config, every: float):
        self.config = config
        self.every = every
        self.start = self.last = time.monotonic()
        self.done = self.failed = 0
        self.running = {}        # file -> when its last report came
        self.durations = []      # (seconds, test id) of every phase of every test

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report):
        now = time.monotonic()
        path = report.nodeid.split("::")[0]
        self.running[path] = now
        self.durations.append((report.duration, report.nodeid))
        if report.when == "call" or (report.when == "setup" and not report.passed):
            self.done += 1
        self.failed += report.failed
        if now - self.last >= self.every:
            self.last = now
            self._write(now)

    def _write(self, now: float) -> None:
        # a file is running while its reports keep coming: within the last interval
        files = sorted(p for p, t in self.running.items() if now - t < self.every)
        self.durations.sort(reverse=True)
        del self.durations[SLOWEST:]
        slowest = ", ".join(f"{nodeid} {seconds:.0f} s" for seconds, nodeid in self.durations)
        minutes, seconds = divmod(int(now - self.start), 60)
        writer = self.config.pluginmanager.get_plugin("terminalreporter")
        writer.ensure_newline()
        writer.write_line(f"[{minutes:d}:{seconds:02d}] {self.done} tests done, {self.failed} "
                          f"failed; running {', '.join(files) or '-'}; slowest so far: "
                          f"{slowest}")


def register(config) -> None:
    """The progress lines in this process, where it reports (not in an xdist worker)."""
    every = config.getoption("--progress")
    if every > 0 and not hasattr(config, "workerinput"):
        config.pluginmanager.register(Progress(config, every), "rlfuse-progress")
