"""Ctrl-C stops the suite, workers and all (tests/conftest.py takes this hook; a pytest of its own loads it with
`-p tests.interrupt`, tests/test_journeys.py).

A shell starts a background job (`pytest &`, a script, an agent's terminal) with SIGINT ignored; Python then installs
no KeyboardInterrupt handler, and pytest and its xdist workers, which inherit the disposition, ran on until killed.
The hook runs in the main process and in every worker."""

import signal


def pytest_configure(config):
  if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
