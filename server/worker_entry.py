"""A worker process's entry point: SIGINT ignored and its device chosen before anything heavy loads.

A terminal's Ctrl-C reaches the whole process group; stopping the workers is the server's job
(it drains, then sends Shutdown), so a worker must not die of that SIGINT, not even while it is
still importing torch. This module imports nothing at load time so the spawned child reaches
`signal.signal` within milliseconds of starting. `CUDA_VISIBLE_DEVICES` is set here too, before
torch initialises CUDA, so that each rank sees exactly its own GPU (as cuda:0).
"""

import os
import signal


def run_worker(rank: int, model_dir: str, config_json: str, request_ring: str, control_ring: str,
               output_ring: str, status_ring: str, num_threads: int, device: str, visible_device: str | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if visible_device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_device
        device = "cuda:0"
    from engine.worker_process import worker_main

    worker_main(rank, model_dir, config_json, request_ring, control_ring, output_ring, status_ring, num_threads, device)
