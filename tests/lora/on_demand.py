"""Helpers of the on-demand adapter tests: a tiny base model's random adapters, an AdapterManager
over them with its reads waited for, and the greedy output a request on one adapter must give."""

import json
import random

import torch

from punica.lora.adapter import load_adapter
from punica.lora.batch import LoraBatch
from punica.lora.dummy import save_random_adapter
from punica.lora.layers import attach_pool
from punica.lora.manager import AdapterManager
from punica.lora.pool import LoraPool
from punica.models.forward_batch import ForwardBatch
from punica.models.loader import load_hf_dir
from punica.ops.attention import AttnBatch


def edit_config(path, **changes):
    file = path / "adapter_config.json"
    file.write_text(json.dumps(json.loads(file.read_text()) | changes))


def model_of(base_dir):
    return load_hf_dir(base_dir / "base", dtype=torch.float32)


def adapter_dirs(base_dir, model, n):
    rng = random.Random(0)
    return {f"t{i}": str(save_random_adapter(base_dir / f"t{i}", model.config, rank=rng.choice([2, 4, 8]), seed=i,
                                             dtype=torch.float32)) for i in range(n)}


def reference_greedy(model, adapter_path, prompt, steps):
    """The model alone with one adapter in a one-slot pool: what the request must produce."""
    pool = LoraPool(model.config, 1, 8, torch.float32, "cpu")
    pool.write(0, load_adapter(adapter_path, model.config))
    attach_pool(model, pool)
    kv = model.new_kv_cache(16, 4)
    tokens, pages = list(prompt), list(range(16))
    for step in range(steps):
        q = len(tokens) if step == 0 else 1
        attn = AttnBatch.build([q], [len(tokens)], [pages], 4, int(step == 0))
        logits = model(torch.tensor(tokens[-q:]), ForwardBatch(attn, LoraBatch.build([0], [q]), kv))
        tokens.append(int(logits[-1].argmax()))
    return tokens[len(prompt):]


def drain(engine):
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    return outs


def manager_with(base_dir, n, slots):
    model = model_of(base_dir)
    pool = LoraPool(model.config, slots, 8, torch.float32, "cpu")
    manager = AdapterManager(model.config, pool, host_capacity_bytes=1 << 30)
    for name, path in adapter_dirs(base_dir, model, n).items():
        manager.register(name, path)
    return manager


def wait_for_reads(manager):
    """Until the reads started so far have finished (not yet taken in by a poll)."""
    for future, _ in list(manager.reads.values()):
        future.result()


def load(manager, name):
    """Acquire, polling until the adapter is resident (reads run on worker threads)."""
    for _ in range(1000):
        slot = manager.acquire(name)
        if slot is not None:
            return slot
        wait_for_reads(manager)
        manager.poll([name])
    raise AssertionError(f"{name} never loaded")


def names(registrations):
    """The adapter names of a manager's registration-keyed collection (resident, host, reads)."""
    return {registration.name for registration in registrations}
