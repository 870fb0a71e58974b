"""punica.ops.cpu_threads: a thread beside the engine's runs torch's CPU ops serially, so it keeps
no OpenMP team of its own, or on teams of the size it sets; other threads keep their thread counts."""

import threading

import torch

from punica.lora.manager import reader_threads
from punica.ops.cpu_threads import serial_torch, torch_threads


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


def test_torch_threads_sizes_the_calling_threads_teams():
    seen = {}

    def beside():
        torch_threads(3)
        seen["threads"] = torch.get_num_threads()
        seen["sum"] = torch.ones(1 << 20).sum().item()

    thread = threading.Thread(target=beside)
    thread.start()
    thread.join()
    assert seen == {"threads": 3, "sum": float(1 << 20)}


def test_adapter_readers_share_the_threads_on_a_gpu_and_run_serially_on_a_cpu():
    """punica.lora.manager.reader_threads: on a GPU host each of n readers gets 1/n of the calling
    thread's count (at least 1); beside a CPU engine, 1."""
    before = torch.get_num_threads()
    for device, num_threads, want in (("cuda", 2, max(1, before // 2)), ("cuda", 3 * before, 1), ("cpu", 2, 1)):
        with reader_threads(torch.device(device), num_threads) as pool:
            assert pool.submit(torch.get_num_threads).result() == want, (device, num_threads)
    assert torch.get_num_threads() == before
