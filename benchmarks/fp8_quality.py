"""FP8 base weights and an FP8 KV cache against the original on real weights: the embedded
SmolLM2-135M-Instruct and its demo adapters, on the CPU.

python -m benchmarks.fp8_quality [--prompts 200] [--greedy-requests 32] [--max-tokens 48]
    [--quantization fp8|none] [--kv-cache-dtype auto|fp8] [--out results/fp8_quality]

Both models load from the same checkpoint (bf16 weights, run in float32): the original (its KV
cache in float32), and the variant: with --quantization fp8 (the default) the 7 projections in
e4m3 with per-output-channel scales, with --kv-cache-dtype fp8 its KV cache in e4m3 with a scale
per (token, KV head) (punica.ops.kv_cache); on the CPU the reference path dequantizes either and
computes in float32. "fp8" below names the variant. Prompts: --prompts chat messages, each
a question template about a topic (a seeded sample of TEMPLATES x TOPICS) through the model's chat
template with the generation prompt; prompt i runs under the base model or a demo adapter
(cycling None, signature, json, pirate), in mixed prefill batches of BATCH prompts.

  * next token of each prompt (the reply's first token): top-1 agreement of the two models' argmax,
    and the mean KL(original || fp8) of the next-token distributions, in nats;
  * every prompt position after the prompts' shared prefix (the chat template's system prompt,
    `shared_prefix_tokens`), teacher-forced: the same two numbers over all those positions;
  * greedy: the first --greedy-requests prompts (adapters mixed) decode --max-tokens tokens greedily in
    one engine batch per model: how many outputs are identical, and where the others first differ.

Writes fp8_quality.json (per adapter rows, the summary in meta) and fp8_quality.png under --out and
prints the tables last.
"""

from __future__ import annotations

import argparse
import itertools
import math
import platform
import random
import time
from pathlib import Path

import torch

from benchmarks.common import format_table, save_figure, write_results
from punica.config import KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig
from punica.demo import demo_adapters
from punica.engine.sampling_params import SamplingParams
from punica.factory import engine_on_model, load_tokenizer
from punica.lora.adapter import load_adapter
from punica.lora.adapter_config import adapter_rank
from punica.lora.batch import LoraBatch
from punica.lora.layers import attach_pool
from punica.lora.pool import LoraPool
from punica.models.forward_batch import ForwardBatch
from punica.models.loader import load_hf_dir
from punica.models.sources import resolve_model_dir
from punica.ops.attention import AttnBatch

BATCH = 20
PAGE_SIZE = 8  # the chat template's system prompt fills whole pages, prefilled once per adapter
TEMPLATES = ("What is {}?", "Explain {} to a child.", "Write one sentence about {}.", "Give me three facts about {}.",
             "Why does {} matter?", "Tell me a short story about {}.", "What is the history of {}?",
             "Summarize {} in a few words.", "Is {} dangerous?", "How would you describe {} to a friend?")
TOPICS = ("the moon", "photosynthesis", "the French revolution", "prime numbers", "a good breakfast", "rainbows",
          "the stock market", "volcanoes", "jazz music", "the internet", "honey bees", "black holes", "chess",
          "climate change", "the Roman empire", "coffee", "electric cars", "the ocean", "sleep", "gravity",
          "bread", "democracy", "the human heart", "mountains", "music theory", "recycling", "tea", "robots")


def chat_prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    """n seeded chat prompts (token ids, generation prompt appended)."""
    pairs = random.Random(seed).sample(list(itertools.product(TEMPLATES, TOPICS)), n)
    return [tokenizer.apply_chat_template([{"role": "user", "content": t.format(topic)}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for t, topic in pairs]


def attach_adapters(model, adapters: dict[str, str]) -> dict[str, int]:
    """The demo adapters in a pool of the model's (one slot each): name -> slot."""
    rank = max(adapter_rank(p) for p in adapters.values())
    pool = LoraPool(model.config, len(adapters), rank, model.embed.weight.dtype, "cpu")
    pool.base_weight = model.group_weight
    for slot, (name, path) in enumerate(adapters.items()):
        pool.write(slot, load_adapter(path, model.config, name))
    attach_pool(model, pool)
    return {name: slot for slot, name in enumerate(adapters)}


@torch.inference_mode()
def query_logits(model, prompts: list[list[int]], slots: list[int], prefix_len: int,
                 kv_cache_dtype: str = "auto") -> torch.Tensor:
    """Logits [sum of (length - prefix_len), V] float32 at every position past the first prefix_len
    (a multiple of PAGE_SIZE, a prefix all prompts share) of one mixed batch: the prefix's KV is
    prefilled once per adapter slot of the batch, into pages each prompt of that slot reads."""
    shared = prefix_len // PAGE_SIZE
    distinct = list(dict.fromkeys(slots))
    prefix_pages = {slot: list(range(i * shared, (i + 1) * shared)) for i, slot in enumerate(distinct)}
    first = len(distinct) * shared
    tables = []
    for p in prompts:
        own = math.ceil(len(p) / PAGE_SIZE) - shared
        tables.append(prefix_pages[slots[len(tables)]] + list(range(first, first + own)))
        first += own
    kv = model.new_kv_cache(first, PAGE_SIZE, kv_cache_dtype)
    if shared:
        lens = [prefix_len] * len(distinct)
        attn = AttnBatch.build(lens, lens, list(prefix_pages.values()), PAGE_SIZE, len(distinct))
        batch = ForwardBatch(attn, LoraBatch.build(distinct, lens), kv)
        model(torch.tensor(prompts[0][:prefix_len] * len(distinct)), batch)
    queries, lens = [len(p) - prefix_len for p in prompts], [len(p) for p in prompts]
    attn = AttnBatch.build(queries, lens, tables, PAGE_SIZE, len(prompts), all_logits=True)
    batch = ForwardBatch(attn, LoraBatch.build(slots, queries), kv)
    return model(torch.tensor([t for p in prompts for t in p[prefix_len:]]), batch)


def compare(ref: torch.Tensor, fp8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-1 agreement [N] bool, KL(ref || fp8) [N] in nats) of rows of logits."""
    log_p, log_q = torch.log_softmax(ref.double(), -1), torch.log_softmax(fp8.double(), -1)
    return ref.argmax(-1) == fp8.argmax(-1), (log_p.exp() * (log_p - log_q)).sum(-1)


def shared_prefix(prompts: list[list[int]]) -> int:
    """Tokens every prompt starts with (the chat template's system prompt)."""
    return next((i for i, column in enumerate(zip(*prompts)) if len(set(column)) > 1), min(map(len, prompts)))


def next_token_metrics(models: dict, kv_dtypes: dict[str, str], prompts: list[list[int]], slots: list[int]
                       ) -> tuple[dict[str, float], torch.Tensor, torch.Tensor]:
    """(summary, each prompt's next-token agreement [P] bool and KL [P]); kv_dtypes: each model's
    KV-cache dtype."""
    last_agree, last_kl, all_agree, all_kl = [], [], [], []
    skip = shared_prefix(prompts)
    prefix_len = skip // PAGE_SIZE * PAGE_SIZE
    for lo in range(0, len(prompts), BATCH):
        batch, batch_slots = prompts[lo:lo + BATCH], slots[lo:lo + BATCH]
        ref, fp8 = (query_logits(models[k], batch, batch_slots, prefix_len, kv_dtypes[k]) for k in ("original", "fp8"))
        ends = torch.tensor([len(p) - prefix_len for p in batch]).cumsum(0)
        agree, kl = compare(ref, fp8)
        last_agree.append(agree[ends - 1])
        last_kl.append(kl[ends - 1])
        own = torch.cat([torch.arange(end - len(p) + skip, end) for p, end in zip(batch, ends.tolist())])
        all_agree.append(agree[own])
        all_kl.append(kl[own])
        print(f"prompts {lo + len(batch)} / {len(prompts)}: next-token top-1 agreement "
              f"{torch.cat(last_agree).double().mean():.3f}", flush=True)
    cat = torch.cat
    return {"next_token_top1_agreement": cat(last_agree).double().mean().item(),
            "next_token_mean_kl": cat(last_kl).mean().item(), "next_token_max_kl": cat(last_kl).max().item(),
            "shared_prefix_tokens": skip, "all_positions": sum(len(a) for a in all_agree),
            "all_positions_top1_agreement": cat(all_agree).double().mean().item(),
            "all_positions_mean_kl": cat(all_kl).mean().item()}, cat(last_agree), cat(last_kl)


def greedy_outputs(model, adapters: dict[str, str], requests: list[tuple[list[int], str | None]],
                   max_tokens: int, kv_cache_dtype: str = "auto") -> list[list[int]]:
    engine = engine_on_model(model, EngineConfig(max_batch_size=len(requests), max_loras=len(adapters),
                                                 kv_cache_tokens=len(requests) * 256, kv_cache_dtype=kv_cache_dtype),
                             adapters)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ids = [engine.add_request(prompt, params, adapter) for prompt, adapter in requests]
    finished = {}
    for outputs in engine.steps():
        finished.update((o.request_id, o.token_ids) for o in outputs if o.finished)
    return [finished[i] for i in ids]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def plot(rows: list[dict], divergences: list[int | None], adapters: list[str | None], max_tokens: int,
         path: Path, label: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    names = [r["adapter"] for r in rows]
    left.bar(names, [r["next_token_top1_agreement"] for r in rows])
    left.axhline(0.95, color="tab:red", linestyle="--", label="target 0.95")
    left.set_title(f"next-token top-1 agreement, {label} vs original", fontsize=9)
    left.set_ylim(0.8, 1.0)
    left.legend(fontsize=7)
    for i, name in enumerate(names):
        firsts = [max_tokens if d is None else d for d, a in zip(divergences, adapters) if (a or "base") == name]
        right.scatter([i] * len(firsts), firsts, s=12)
    right.set_xticks(range(len(names)), names)
    right.set_title(f"greedy: first differing output token ({max_tokens}: identical)", fontsize=9)
    for ax in (left, right):
        ax.grid(True, axis="y", alpha=0.3)
    save_figure(fig, path, f"{label} vs original, SmolLM2-135M-Instruct + demo adapters, CPU")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--greedy-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default="fp8", help="the variant's base weights")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="the variant's KV cache")
    parser.add_argument("--out", type=Path, default=Path("results/fp8_quality"))
    args = parser.parse_args()
    if args.quantization == "none" and args.kv_cache_dtype == "auto":
        parser.error("the variant must differ from the original: --quantization fp8 or --kv-cache-dtype fp8")
    label = " + ".join(([] if args.quantization == "none" else ["fp8 weights"])
                       + ([] if args.kv_cache_dtype == "auto" else ["fp8 KV cache"]))
    started = time.time()
    model_dir = resolve_model_dir(None)
    tokenizer = load_tokenizer(model_dir)
    adapters = demo_adapters()
    models = {"original": load_hf_dir(model_dir, torch.float32),
              "fp8": load_hf_dir(model_dir, torch.float32, quantization=args.quantization)}
    kv_dtypes = {"original": "auto", "fp8": args.kv_cache_dtype}
    prompts = chat_prompts(tokenizer, args.prompts)
    names = [None, *adapters]
    request_adapters = [names[i % len(names)] for i in range(len(prompts))]
    for model in models.values():
        slot_of = attach_adapters(model, adapters)
    slots = [-1 if a is None else slot_of[a] for a in request_adapters]
    metrics, agree, kl = next_token_metrics(models, kv_dtypes, prompts, slots)
    print(f"next-token metrics of {len(prompts)} prompts: {time.time() - started:.1f} s", flush=True)
    requests = list(zip(prompts, request_adapters))[:args.greedy_requests]
    outputs = {k: greedy_outputs(m, adapters, requests, args.max_tokens, kv_dtypes[k]) for k, m in models.items()}
    divergences = [first_divergence(a, b) for a, b in zip(outputs["original"], outputs["fp8"])]
    diverged = [d for d in divergences if d is not None]
    rows = []
    for name in names:
        mine = torch.tensor([a == name for a in request_adapters])
        firsts = [d for d, (_, a) in zip(divergences, requests) if a == name and d is not None]
        rows.append({"adapter": name or "base", "prompts": int(mine.sum()),
                     "next_token_top1_agreement": agree[mine].double().mean().item(),
                     "next_token_mean_kl": kl[mine].mean().item(),
                     "greedy_requests": sum(a == name for _, a in requests),
                     "greedy_identical": sum(d is None for d, (_, a) in zip(divergences, requests) if a == name),
                     "first_divergence_min": min(firsts, default=None),
                     "first_divergence_mean": sum(firsts) / len(firsts) if firsts else None})
    summary = metrics | {"greedy_requests": len(requests), "greedy_max_tokens": args.max_tokens,
                         "greedy_identical": len(requests) - len(diverged),
                         "greedy_first_divergence_mean": sum(diverged) / len(diverged) if diverged else None,
                         "greedy_first_divergence_min": min(diverged, default=None)}
    meta = {"device": "cpu", "cpu": platform.processor() or platform.machine(), "model": model_dir.name,
            "adapters": list(adapters), "prompts": len(prompts), "dtype": "float32",
            "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype, "variant": label,
            "seconds": time.time() - started, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
            "summary": summary}
    write_results(args.out, "fp8_quality", rows, meta)
    plot(rows, divergences, [a for _, a in requests], args.max_tokens, args.out / "fp8_quality.png", label)
    print(meta)
    print(format_table([{"metric": k, "value": f"{v:.4g}" if isinstance(v, float) else v} for k, v in summary.items()],
                       ["metric", "value"]))
    print(format_table([{k: f"{v:.4g}" if isinstance(v, float) else v for k, v in r.items()} for r in rows],
                       list(rows[0])))


if __name__ == "__main__":
    main()
