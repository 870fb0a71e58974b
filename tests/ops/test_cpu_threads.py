"""punica.ops.cpu_threads: a thread beside the engine's runs torch's CPU ops serially, so it keeps
no OpenMP team of its own; other threads keep their thread counts."""

import threading

import torch

from punica.ops.cpu_threads import serial_torch


def test_serial_torch_makes_the_calling_thread_alone_serial():
    before = torch.get_num_threads()
    seen = {}

    def beside():
        serial_torch()
        seen["threads"] = torch.get_num_threads()
        seen["sum"] = torch.ones(1 << 20).sum().item()  # past torch's grain: would run in parallel

    thread = threading.Thread(target=beside)
    thread.start()
    thread.join()
    assert seen == {"threads": 1, "sum": float(1 << 20)}
    assert torch.get_num_threads() == before
    other = {}
    thread = threading.Thread(target=lambda: other.update(threads=torch.get_num_threads()))
    thread.start()
    thread.join()
    assert other["threads"] == before
