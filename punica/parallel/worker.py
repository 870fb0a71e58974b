"""A tensor-parallel worker: rank r > 0, one process, driven by rank 0 through a pipe.

Rank 0 runs the Engine (scheduler, adapter manager, sampler, server); a worker holds rank r's
ModelWorker: its shard of the model, its KV cache (its kv heads) and its adapter pool, and does
what rank 0 tells it, in order:

    ("step", StepInput)            run the step on this rank's shard; the logits are dropped
                                   (rank 0's suffice: lm_head is replicated)
    ("write", slot, scale) + bytes write rank r's packed shard of an adapter into `slot`
    ("stop",)                      leave

Steps and writes reach every rank in the order rank 0 issued them, so a worker's pool holds
the same adapters in the same slots as rank 0's at every step, and the model's all-reduces
pair up across ranks. A worker builds its ModelWorker exactly as rank 0 does (same config, same
KV pages), so its runner captures the same CUDA graphs, with the same collectives, at the same
time. It exits when told to stop or when rank 0's
end of the pipe closes (rank 0 exited or died), and reports its own failure on the pipe.
"""

from __future__ import annotations

import signal
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist

from punica.config import EngineConfig
from punica.engine.worker import ModelWorker, kv_cache_pages
from punica.models.decoder import DecoderForCausalLM
from punica.models.loader import DummyWeights, load_weights
from punica.parallel.launcher import exit_after_clean_stop, init_rank
from punica.parallel.tensor_parallel import shard_model_


def load_shard(source: str | Path | DummyWeights, dtype: torch.dtype, device: torch.device,
               quantization: str = "none") -> DecoderForCausalLM:
    """This rank's shard of a checkpoint directory's model or of random weights: built on the meta
    device, sharded there, then only its slices are read or generated, straight onto `device`."""
    return load_weights(source, dtype, device, shard=lambda model: shard_model_(model, dist.group.WORLD),
                        quantization=quantization)


def worker_main(rank: int, world_size: int, backend: str, workdir: str, conn: Connection,
                source: str | Path | DummyWeights, dtype: torch.dtype, config: EngineConfig, timeout_s: float,
                quantization: str = "none") -> None:
    """A worker process: join the group, load the shard, agree on KV pages, then obey rank 0."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is rank 0's to handle
    torch.set_num_threads(max(1, torch.get_num_threads() // world_size))
    try:
        conn.send(("started", None))  # rank 0 joins the group only once every worker could start
        device = init_rank(rank, world_size, backend, workdir, timeout_s)
        model = load_shard(source, dtype, device, quantization)
        conn.send(("ready", kv_cache_pages(model, config)))
        _, num_pages = conn.recv()
        serve(conn, ModelWorker(model, config, num_pages))
    except EOFError:
        pass  # rank 0 has gone: nothing is left to do
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    exit_after_clean_stop()


def serve(conn: Connection, worker: ModelWorker) -> None:
    """Run rank 0's steps and adapter writes until told to stop."""
    pool = worker.pool
    staging = torch.empty(pool.slot_numel, dtype=pool.buffer.dtype, pin_memory=pool.buffer.is_cuda)
    while True:
        message = conn.recv()
        if message[0] == "step":
            worker.runner.run(message[1])
        elif message[0] == "write":
            _, slot, scale = message
            if conn.recv_bytes_into(staging.view(torch.uint8).numpy()) != staging.nbytes:
                raise ValueError(f"rank 0 sent an adapter slot of a different size than {staging.nbytes} bytes")
            pool.write_packed(slot, staging, scale)
        elif message[0] == "stop":
            return
        else:
            raise ValueError(f"unknown message {message[0]!r} from rank 0")
