"""DoRA adapters (PEFT's use_dora) in the same batches as plain LoRA and base requests, against
transformers + PEFT per request (fp32, greedy, token for token)."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from punica.config import EngineConfig
from punica.engine.sampling_params import SamplingParams, SamplingParamsError
from punica.factory import engine_on_model
from punica.models.loader import load_hf_dir

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# name -> (rank, alpha, targets, LoraConfig extras): all 7 projections at two ranks, and one on some
# projections of one layer (k of q/k/v and layer 0 have no magnitudes: their outputs are left as they are)
DORA_ADAPTERS = {"d4": (4, 8, ALL, {}), "d8": (8, 16, ALL, {}),
                 "d16": (16, 32, ("q_proj", "v_proj", "gate_proj", "down_proj"), {"layers_to_transform": [1]})}


def save_dora_adapter(hf, path, make_peft_adapter, r, alpha, targets, seed, **kw):
    """A PEFT DoRA adapter whose magnitudes are moved off their initial ||W + s B A|| (where DoRA
    would equal plain LoRA) by random factors in [0.5, 1.5]."""
    path = make_peft_adapter(hf, path, r=r, alpha=alpha, targets=targets, seed=seed, use_dora=True, **kw)
    weights = load_file(path / "adapter_model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    magnitudes = [k for k in weights if "lora_magnitude_vector" in k]
    assert magnitudes
    for key in magnitudes:
        weights[key] = weights[key] * (torch.rand(weights[key].shape, generator=gen) + 0.5)
    save_file(weights, str(path / "adapter_model.safetensors"))
    return path


@pytest.fixture(scope="module")
def dora_setup(setup, tmp_path_factory, tiny_llama, make_peft_adapter, load_peft_model):
    """(base directory, every adapter name -> directory, a PeftModel with all of them)."""
    base, paths, _ = setup
    hf = tiny_llama(seed=5)
    tmp = tmp_path_factory.mktemp("dora")
    dora = {n: str(save_dora_adapter(hf, tmp / n, make_peft_adapter, r, a, t, seed=10 + i, **kw))
            for i, (n, (r, a, t, kw)) in enumerate(DORA_ADAPTERS.items())}
    everything = paths | dora
    return base, everything, load_peft_model(hf, everything)


def peft_greedy(peft_model, prompt, adapter, steps, device="cpu"):
    """Greedy tokens of transformers + PEFT with one active adapter (None: the base model)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            if adapter is None:
                with peft_model.disable_adapter():
                    logits = peft_model(torch.tensor([tokens], device=device)).logits[0, -1]
            else:
                peft_model.set_adapter(adapter)
                logits = peft_model(torch.tensor([tokens], device=device)).logits[0, -1]
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


@pytest.mark.slow
def test_dora_and_lora_and_base_in_one_batch_match_transformers_peft(dora_setup, workload):
    base, paths, peft_model = dora_setup
    engine = engine_on_model(load_hf_dir(base, dtype=torch.float32), EngineConfig(max_batch_size=8, page_size=4),
                             paths)
    names = [None, "d4", "a", "d8", "c", "d16"]
    requests = [(prompt, names[i % len(names)], n) for i, (prompt, _, n) in enumerate(workload(12, seed=21))]
    ids = [engine.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), a)
           for p, a, n in requests]
    outs = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    for (prompt, adapter, n), request_id in zip(requests, ids):
        assert outs[request_id].finish_reason == "length", outs[request_id]
        assert outs[request_id].token_ids == peft_greedy(peft_model, prompt, adapter, n), (adapter, prompt)
    pool = engine.executor.worker.pool
    held = {name: slot for name, slot in ((r.name, s) for r, s in engine.adapters.resident.items())}
    assert {name for name, slot in held.items() if pool.dora_slots[slot]} == set(DORA_ADAPTERS) & set(held)


def test_dora_outputs_differ_from_the_same_weights_as_plain_lora(dora_setup, tmp_path):
    """The magnitudes matter: without them (use_dora off) the same A and B give other tokens."""
    import json
    import shutil
    base, paths, peft_model = dora_setup
    plain = tmp_path / "plain"
    shutil.copytree(paths["d8"], plain)
    weights = {k: v for k, v in load_file(plain / "adapter_model.safetensors").items() if "magnitude" not in k}
    save_file(weights, str(plain / "adapter_model.safetensors"))
    config = json.loads((plain / "adapter_config.json").read_text()) | {"use_dora": False}
    (plain / "adapter_config.json").write_text(json.dumps(config))
    engine = engine_on_model(load_hf_dir(base, dtype=torch.float32), EngineConfig(max_batch_size=4),
                             {"d8": paths["d8"], "plain": str(plain)})
    prompt = [5, 17, 33, 2, 90, 11, 8]
    ids = [engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), a)
           for a in ("d8", "plain")]
    outs = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
    assert outs[ids[0]] == peft_greedy(peft_model, prompt, "d8", 8)
    assert outs[ids[0]] != outs[ids[1]]
    with pytest.raises(SamplingParamsError, match="not supported on the DoRA adapter 'd8'") as e:
        engine.add_request(prompt, SamplingParams(lora_scale=0.5), "d8")
    assert e.value.field == "lora_scale"


@pytest.mark.cuda
def test_dora_through_cuda_graphs_matches_eager_and_transformers_peft(dora_setup, monkeypatch, workload, run_all,
                                                                      greedy):
    """On the GPU (fp32): an engine replaying CUDA graphs gives the eager engine's tokens and
    transformers + PEFT's (on the GPU too), DoRA, plain LoRA and base requests sharing steps."""
    from punica.engine.cuda_graphs import CudaGraphs

    replays = []
    run = CudaGraphs.run

    def spy(self, step):
        logits = run(self, step)
        if logits is not None:
            replays.append(set(step.request_slots.tolist()))
        return logits

    monkeypatch.setattr(CudaGraphs, "run", spy)
    base, paths, peft_model = dora_setup
    names = [None, "d4", "a", "d8", "c", "d16"]
    requests = [(prompt, names[i % len(names)], n) for i, (prompt, _, n) in enumerate(workload(18, seed=22))]
    outputs = {}
    for eager in (True, False):
        engine = engine_on_model(load_hf_dir(base, dtype=torch.float32, device="cuda"),
                                 EngineConfig(max_batch_size=8, kv_cache_tokens=4096, enforce_eager=eager), paths)
        assert engine.executor.worker.uses_cuda_graphs != eager
        # the adapters resident first: the steps' mix then does not depend on when a load completes
        run_all(engine, [([5, 6, 7], name, 1) for name in names[1:]], greedy)
        replays.clear()
        ids = [engine.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), a)
               for p, a, n in requests]
        done = {}
        while engine.has_unfinished():
            done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
        outputs[eager] = [done[i] for i in ids]
    assert outputs[False] == outputs[True]
    assert any(len(slots) > 3 for slots in replays), "replayed steps mixed DoRA, LoRA and base rows"
    peft_model = peft_model.to("cuda")
    try:
        for (prompt, adapter, n), tokens in zip(requests, outputs[False]):
            reference = peft_greedy(peft_model, prompt, adapter, n, device="cuda")
            assert tokens == reference, (adapter, prompt)
    finally:
        peft_model.to("cpu")
