"""`punica generate ...`: the command line."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
import sys

SIM_REQUESTS = 60_000      # the Fig. 13 rate on 16 H200s: a peak of ~26 requests/s
SIM_KV_TOKENS = 200_000    # a 7B model's KV cache in bf16 on an H200 (0.5 MiB a token, ~100 GiB)


def package_version() -> str:
    try:
        return importlib.metadata.version("punica")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def parse_adapters(items: list[str]) -> dict[str, str]:
    adapters = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--adapter expects NAME=PATH, got {item!r}")
        adapters[name] = path
    return adapters


def json_schema_constraint(path: str | None):
    """The StructuredOutputs of --json-schema FILE (None without it), checked by the grammar engine;
    ValueError naming what is wrong."""
    if path is None:
        return None
    from punica.engine.constraint import GrammarError
    from punica.engine.sampling_params import SamplingParamsError, StructuredOutputs
    from punica.engine.structured import check_grammar

    try:
        spec = StructuredOutputs(json=open(path, encoding="utf-8").read())
        check_grammar(spec)
    except OSError as e:
        raise ValueError(f"--json-schema: cannot read {path}: {e.strerror}") from e
    except (SamplingParamsError, GrammarError) as e:
        raise ValueError(f"--json-schema {path}: {e}") from e
    return spec


def cmd_generate(args: argparse.Namespace) -> int:
    from punica.config import EngineArgs
    from punica.engine.sampling_params import SamplingParams
    from punica.factory import startup_adapters
    from punica.flags import from_arguments
    from punica.llm import LLM

    # every argument is checked before the model loads
    engine_args = from_arguments(EngineArgs, args)
    adapters = parse_adapters(args.adapter) or None
    served = startup_adapters(engine_args, adapters)
    if args.use is not None and args.use not in served:
        raise ValueError(f"--use {args.use!r} names no adapter being served (served: {', '.join(served) or 'none'})")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                            structured_outputs=json_schema_constraint(args.json_schema))
    llm = LLM(adapters=adapters, **dataclasses.asdict(engine_args))
    try:
        prompt = args.prompt if args.raw else llm.chat_prompt(args.prompt)
        out = llm.generate(prompt, params, adapter=args.use)[0]
    finally:
        llm.close()
    print(out.text)
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from punica.cluster.policy_config import PolicyConfig
    from punica.cluster.report import NO_PLOTS, can_plot, simulate, table
    from punica.cluster.step_time import load_model
    from punica.flags import from_arguments

    if args.light_load_batch > args.max_batch_size:
        raise ValueError(f"--light-load-batch {args.light_load_batch} is over --max-batch-size {args.max_batch_size}")
    if args.max_total > args.kv_tokens:
        raise ValueError(f"--max-total {args.max_total} is over --kv-tokens {args.kv_tokens}: a request could "
                         "outgrow every GPU's KV cache")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ValueError(f"--out {args.out} is a file, not a directory")
    policy_config = from_arguments(PolicyConfig, args)
    plots = can_plot()
    results = simulate(args.gpus, args.requests, args.duration, args.kv_tokens, args.policy, Path(args.out),
                       load_model(args.step_time), policy_config, args.gpu_startup_s, args.max_total, args.seed,
                       args.adapters, args.zipf_alpha, args.host_tier_adapters, plots)
    print(table(results))
    if not plots:
        print(NO_PLOTS)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from punica.config import EngineArgs
    from punica.flags import from_arguments
    from punica.server.args import ServerArgs
    from punica.server.serve import serve

    server = from_arguments(ServerArgs, args, api_key=args.api_key or os.environ.get("PUNICA_API_KEY"),
                            admin_api_key=args.admin_api_key or os.environ.get("PUNICA_ADMIN_API_KEY"))
    serve(from_arguments(EngineArgs, args), server, parse_adapters(args.adapter) or None)
    return 0


def cmd_hash_key(args: argparse.Namespace) -> int:
    """Print the hash of the API key on stdin's first line, as a tenants file stores it."""
    import getpass

    from punica.server.tenants import hash_key

    key = getpass.getpass("API key: ") if sys.stdin.isatty() else sys.stdin.readline().rstrip("\r\n")
    if not key:
        raise SystemExit("punica hash-key: the key is empty")
    print(hash_key(key))
    return 0


def add_engine_args(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    from punica.config import EngineArgs
    from punica.flags import add_arguments

    add_arguments(p, EngineArgs, skip=skip)
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH",
                   help="a PEFT LoRA adapter directory to serve (default for the embedded model: its demo adapters)")


def build_parser() -> argparse.ArgumentParser:
    from punica.cluster.placement import POLICIES
    from punica.cluster.policy_config import PolicyConfig
    from punica.cluster.step_time import DEFAULT_MODEL, MODELS
    from punica.flags import add_arguments, bounded
    from punica.server.args import ServerArgs

    parser = argparse.ArgumentParser(prog="punica", description="Multi-tenant LoRA serving")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt")
    gen.add_argument("--prompt", required=True)
    add_engine_args(gen, skip=("workers",))
    gen.add_argument("--use", default=None, metavar="NAME", help="the adapter to generate with (default: base model)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--json-schema", default=None, metavar="FILE",
                     help="constrain the output to JSON valid under the JSON schema in FILE")
    gen.set_defaults(func=cmd_generate)
    srv = sub.add_parser("serve", help="the OpenAI-compatible server (no arguments: the demo)")
    add_engine_args(srv)
    add_arguments(srv, ServerArgs)
    srv.set_defaults(func=cmd_serve)
    hash_key = sub.add_parser("hash-key", help="read an API key on stdin, print its hash for a --tenants file")
    hash_key.set_defaults(func=cmd_hash_key)
    sim = sub.add_parser("simulate", help="simulate the cluster scheduler on the paper's Fig. 13 workload "
                                          "(defaults: its setting, on the H200-measured 7B model)")
    sim.add_argument("--gpus", type=bounded(int, 1), default=16, help="GPUs the cluster may hold")
    sim.add_argument("--requests", type=bounded(int, 1), default=SIM_REQUESTS)
    sim.add_argument("--duration", type=bounded(float, 0, exclusive=True), default=3600.0,
                     help="seconds over which requests arrive")
    sim.add_argument("--kv-tokens", type=bounded(int, 1), default=SIM_KV_TOKENS,
                     help="KV cache of one GPU, in tokens (at least --max-total)")
    sim.add_argument("--max-total", type=bounded(int, 2), default=2048,
                     help="longest prompt + output, in tokens (a request has at least one of each)")
    sim.add_argument("--adapters", type=bounded(int, 1), default=None, help="adapters the requests draw from "
                                                                            "(default: one per request)")
    sim.add_argument("--zipf-alpha", type=bounded(float, 0, exclusive=True), default=1.5,
                     help="adapter popularity: Zipf exponent")
    sim.add_argument("--policy", nargs="+", default=["punica", "adapter-aware", "round-robin", "least-loaded"],
                     choices=list(POLICIES))
    add_arguments(sim, PolicyConfig)
    sim.add_argument("--host-tier-adapters", type=bounded(int, 1), default=48,
                     help="adapters each GPU's host tier holds")
    sim.add_argument("--gpu-startup-s", type=bounded(float, 0), default=30.0)
    sim.add_argument("--step-time", default=DEFAULT_MODEL, metavar="NAME|JSON",
                     help=f"the GPU model: {', '.join(MODELS)}, or a JSON file of its fields (default: %(default)s)")
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
