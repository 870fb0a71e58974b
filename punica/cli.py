"""`punica generate ...`: the command line."""

from __future__ import annotations

import argparse
import os
import sys

from punica.server.limits import DEFAULT_MAX_REQUEST_BYTES
from punica.server.shutdown import DEFAULT_SHUTDOWN_TIMEOUT_S


def parse_adapters(items: list[str]) -> dict[str, str]:
    adapters = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--adapter expects NAME=PATH, got {item!r}")
        adapters[name] = path
    return adapters


def cmd_generate(args: argparse.Namespace) -> int:
    from punica import LLM, SamplingParams

    adapters = parse_adapters(args.adapter)
    if args.use is not None and args.use not in adapters:
        raise SystemExit(f"--use {args.use!r} names no --adapter (given: {', '.join(adapters) or 'none'})")
    llm = LLM(model=args.model, adapters=adapters, dtype=args.dtype, device=args.device,
              enforce_eager=args.enforce_eager, tensor_parallel_size=args.tensor_parallel_size)
    prompt = args.prompt if args.raw else llm.chat_prompt(args.prompt)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    out = llm.generate(prompt, params, adapter=args.use)[0]
    print(out.text)
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from punica.cluster.policy import PolicyConfig
    from punica.cluster.report import simulate, table
    from punica.cluster.step_time import CPU_SMOLLM2, StepTimeModel

    step_time = StepTimeModel.from_json(args.step_time) if args.step_time else CPU_SMOLLM2
    policy_config = PolicyConfig(args.max_batch_size, args.light_load_batch, args.idle_release_s)
    results = simulate(args.gpus, args.requests, args.duration, args.kv_tokens, args.policy, Path(args.out),
                       step_time, policy_config, args.gpu_startup_s, args.max_total, args.seed)
    print(table(results))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from punica.server.serve import serve

    engine_kwargs = {"max_batch_size": args.max_batch_size, "max_loras": args.max_loras,
                     "kv_cache_tokens": args.kv_cache_tokens, "max_model_len": args.max_model_len,
                     "enforce_eager": args.enforce_eager}
    if args.max_lora_rank is not None:
        engine_kwargs["max_lora_rank"] = args.max_lora_rank
    serve(args.host, args.port, args.max_request_bytes, args.shutdown_timeout,
          model=args.model, adapters=parse_adapters(args.adapter) or None,
          adapter_dirs=args.adapter_dir, api_key=args.api_key or os.environ.get("PUNICA_API_KEY"),
          max_queue=args.max_queue, served_model_name=args.served_model_name, device=args.device,
          dtype=args.dtype, workers=args.workers, tensor_parallel_size=args.tensor_parallel_size, **engine_kwargs)
    return 0


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH", help="a PEFT LoRA adapter directory")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: do not capture decode steps as CUDA graphs")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="shard the model over N devices (N processes; GPUs 0..N-1 on CUDA)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="punica", description="Multi-tenant LoRA serving")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt")
    gen.add_argument("--prompt", required=True)
    add_model_args(gen)
    gen.add_argument("--use", default=None, metavar="NAME", help="the adapter to generate with (default: base model)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.set_defaults(func=cmd_generate)
    srv = sub.add_parser("serve", help="the OpenAI-compatible server (no arguments: the demo)")
    add_model_args(srv)
    srv.add_argument("--adapter-dir", action="append", default=[], metavar="DIR",
                     help="serve every adapter in DIR; /v1/load_lora_adapter may load only from these")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or set PUNICA_API_KEY)")
    srv.add_argument("--served-model-name", default=None, help="the base model's name in the API")
    srv.add_argument("--max-batch-size", type=int, default=32)
    srv.add_argument("--max-loras", type=int, default=8, help="adapters on the GPU at once")
    srv.add_argument("--max-lora-rank", type=int, default=None)
    srv.add_argument("--kv-cache-tokens", type=int, default=None)
    srv.add_argument("--max-model-len", type=int, default=None)
    srv.add_argument("--max-queue", type=int, default=1024, help="waiting requests before 429")
    srv.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="N",
                     help="a request body over N bytes is refused with 413 as it arrives (default: 8 MiB)")
    srv.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S, metavar="S",
                     help="on SIGTERM, seconds in-flight requests may still run before they end with "
                          "finish_reason 'abort' (default: %(default)g)")
    srv.add_argument("--workers", type=int, default=0,
                     help="run N engine workers on Ray (one GPU each) behind the Punica cluster scheduler")
    srv.set_defaults(func=cmd_serve)
    sim = sub.add_parser("simulate", help="simulate the cluster scheduler on the paper's Fig. 13 workload")
    sim.add_argument("--gpus", type=int, required=True, help="GPUs the cluster may hold")
    sim.add_argument("--requests", type=int, default=10_000)
    sim.add_argument("--duration", type=float, default=3600.0, help="seconds over which requests arrive")
    sim.add_argument("--kv-tokens", type=int, default=65_536, help="KV cache of one GPU, in tokens")
    sim.add_argument("--max-total", type=int, default=2048, help="longest prompt + output, in tokens")
    sim.add_argument("--policy", nargs="+", default=["punica", "round-robin", "least-loaded"])
    sim.add_argument("--max-batch-size", type=int, default=32)
    sim.add_argument("--light-load-batch", type=int, default=16, help="ask for a GPU when every batch is this large")
    sim.add_argument("--idle-release-s", type=float, default=60.0)
    sim.add_argument("--gpu-startup-s", type=float, default=30.0)
    sim.add_argument("--step-time", default=None, metavar="JSON", help="step-time coefficients (default: CPU-measured)")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--out", required=True, help="directory for simulate.json and the PNGs")
    sim.set_defaults(func=cmd_simulate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"punica: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
