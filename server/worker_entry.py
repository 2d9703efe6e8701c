"""A worker process's entry point: SIGINT ignored before anything heavy is imported.

A terminal's Ctrl-C reaches the whole process group; stopping the workers is the server's job
(it drains, then sends Shutdown), so a worker must not die of that SIGINT, not even while it is
still importing torch. This module imports nothing at load time so the spawned child reaches
`signal.signal` within milliseconds of starting.
"""

import signal


def run_worker(*args) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from engine.worker_process import worker_main

    worker_main(*args)
