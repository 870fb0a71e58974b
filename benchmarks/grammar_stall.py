"""Does one client's grammar hold up another client's running stream? And when is it answered?

python -m benchmarks.grammar_stall [--max-tokens 160] [--out results/grammar_stall]
python -m benchmarks.grammar_stall --plot results/grammar_stall/grammar_stall.json   # its PNG, beside it

A server of the embedded model (punica serve's app, in this process, on a free 127.0.0.1 port). For
each case, client A streams a greedy completion of --max-tokens tokens (ignore_eos); once it has
streamed a quarter of them, client B sends a 4-token completion constrained by the case's grammar.
Reported, from A's inter-token gaps: its steady gap (median before B was sent) and its longest gap
before B (what the machine's own noise does); while B's grammar compiles (xgrammar's compile timed
in this process), the median and longest gap and how many gaps exceed two steady gaps (one step
late), against the same count before B; the longest gap while B runs in the batch (its prefill and
masks, not its compile: compare the case "unconstrained", the same B without a grammar); B's status
and seconds to its answer. Cases:
  nested_900      the 25 KB schema of `{"type":"array","items":` x900 (48 s for xgrammar to compile):
                  refused before compiling, over --max-grammar-depth
  nested_256      the same nesting at 256 levels (the most --max-grammar-depth allows), a server with
                  --max-grammar-depth 256: compiled on the pool's threads while A streams
  choice_256x256  256 choices of 256 characters (64 KB, within --max-grammar-chars)
  schema_50       50 required properties (benchmarks.structured), the common case
  unconstrained   B without a grammar: what B joining A's batch costs A by itself
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time
from pathlib import Path

import httpx

from benchmarks.common import format_table, save_figure, write_results
from benchmarks.structured import schema_50
from punica.config import EngineArgs
from punica.server.app import build_app
from punica.server.serve import build_state


def nested_arrays(depth: int) -> str:
    return '{"type":"array","items":' * depth + '{"type":"string"}' + "}" * depth


CASES = {  # name -> (the request fields of B's constraint, the server's max_grammar_depth)
    "nested_900": ({"guided_json": json.loads(nested_arrays(900))}, 64),
    "nested_256": ({"guided_json": json.loads(nested_arrays(255))}, 256),
    "choice_256x256": ({"guided_choice": [f"{i:03d}" + "abcdefgh" * 31 + "abcde" for i in range(256)]}, 64),
    "schema_50": ({"guided_json": schema_50("bench")}, 64),
    "unconstrained": ({}, 64),
}
COMPILES = ("compile_json_schema", "compile_grammar", "compile_regex")


class CompileTimes:
    """xgrammar's compiles in this process, timed: (start, end) of each, on time.monotonic()."""

    def __init__(self):
        import xgrammar as xgr

        self.spans: list[tuple[float, float]] = []
        for name in COMPILES:
            setattr(xgr.GrammarCompiler, name, self._timed(getattr(xgr.GrammarCompiler, name)))

    def _timed(self, compile_fn):
        def timed(compiler, *args, **kwargs):
            start = time.monotonic()
            try:
                return compile_fn(compiler, *args, **kwargs)
            finally:
                self.spans.append((start, time.monotonic()))
        return timed


class Server:
    def __init__(self, max_grammar_depth: int):
        import uvicorn

        state = build_state(EngineArgs(max_batch_size=4, max_grammar_depth=max_grammar_depth))
        self.model = state.base_model_name
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.url = f"http://127.0.0.1:{s.getsockname()[1]}"
        config = uvicorn.Config(build_app(state), host="127.0.0.1", port=int(self.url.rsplit(":", 1)[1]),
                                log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def run_case(server: Server, name: str, constraint: dict, max_tokens: int, compiles: CompileTimes) -> dict:
    arrivals: list[float] = []
    b_sent = threading.Event()
    b_result: dict = {}

    def client_b():
        start = time.monotonic()
        b_sent.set()
        with httpx.Client(timeout=300) as http:
            r = http.post(server.url + "/v1/completions", json={"model": server.model, "prompt": "Data:",
                                                                 "max_tokens": 4, **constraint})
        b_result.update(status=r.status_code, sent=start, answered=time.monotonic(),
                        message=r.json().get("error", {}).get("message", "") if r.status_code != 200 else "")

    b = threading.Thread(target=client_b)
    body = {"model": server.model, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=300) as http, http.stream("POST", server.url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                arrivals.append(time.monotonic())
                if len(arrivals) == max_tokens // 4:
                    b.start()
    b.join()
    gaps = [(later, later - earlier) for earlier, later in zip(arrivals, arrivals[1:])]
    sent, answered = b_result["sent"], b_result["answered"]
    spans = [(start, end) for start, end in compiles.spans if start >= sent]
    compiled_at = max((end for _, end in spans), default=sent)
    before = [g for t, g in gaps if t < sent]
    steady = statistics.median(before)
    # a gap ending while the compile ran, or within one steady gap after (the step it delayed)
    compiling = [g for t, g in gaps if sent <= t <= compiled_at + steady] if spans else []
    running = [g for t, g in gaps if compiled_at + steady < t <= answered + steady]
    return {"case": name, "steady_gap_ms": 1e3 * steady, "max_gap_before_b_ms": 1e3 * max(before),
            "late_before_b": f"{sum(g > 2 * steady for g in before)}/{len(before)}",
            "compile_s": sum(end - start for start, end in spans),
            "median_gap_compiling_ms": 1e3 * statistics.median(compiling) if compiling else None,
            "max_gap_compiling_ms": 1e3 * max(compiling) if compiling else None,
            "late_compiling": f"{sum(g > 2 * steady for g in compiling)}/{len(compiling)}",
            "max_gap_b_running_ms": 1e3 * max(running, default=0.0),
            "b_status": b_result["status"], "b_answer_s": answered - sent, "b_message": b_result["message"][:100],
            "gaps_ms": [1e3 * g for _, g in gaps], "b_sent_s": sent - arrivals[0],
            "b_compiled_s": compiled_at - arrivals[0], "b_answered_s": answered - arrivals[0]}


COLUMNS = ["case", "steady_gap_ms", "max_gap_before_b_ms", "late_before_b", "compile_s", "median_gap_compiling_ms",
           "max_gap_compiling_ms", "late_compiling", "max_gap_b_running_ms", "b_status", "b_answer_s"]


def plot(result: Path) -> Path:
    import matplotlib.pyplot as plt

    data = json.loads(result.read_text())
    rows = data["rows"]
    fig, axes = plt.subplots(len(rows), 1, figsize=(7, 2 * len(rows)), sharex=True)
    for ax, row in zip(axes, rows):
        times = [sum(row["gaps_ms"][: i + 1]) / 1e3 for i in range(len(row["gaps_ms"]))]
        ax.plot(times, row["gaps_ms"], lw=0.8)
        ax.axvspan(row["b_sent_s"], row["b_compiled_s"], color="tab:red", alpha=0.3)
        ax.axvspan(row["b_compiled_s"], row["b_answered_s"], color="tab:orange", alpha=0.3)
        ax.set_title(f"{row['case']}: B answered {row['b_status']} after {row['b_answer_s']:.2f} s", fontsize=8)
        ax.set_ylabel("A's gap (ms)", fontsize=7)
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("seconds into A's stream (red: B's grammar compiling; orange: B in the batch)", fontsize=8)
    path = result.with_suffix(".png")
    save_figure(fig, path, f"{data['meta']['model']}, {data['meta']['device']}")
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plot", type=Path, default=None, help="only plot this result JSON")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--out", type=Path, default=Path("results/grammar_stall"))
    args = parser.parse_args()
    if args.plot is not None:
        print(plot(args.plot))
        return
    rows, servers, compiles = [], {}, CompileTimes()
    try:
        for name in args.cases:
            constraint, depth = CASES[name]
            if depth not in servers:
                servers[depth] = Server(depth)
            run_case(servers[depth], "warm-up", {"guided_regex": "[0-9]{2}"}, 16, compiles)
            rows.append(run_case(servers[depth], name, constraint, args.max_tokens, compiles))
            print(format_table([rows[-1]], COLUMNS), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    import torch

    meta = {"model": "SmolLM2-135M-Instruct (embedded)", "device": "cuda" if torch.cuda.is_available() else "cpu",
            "max_tokens": args.max_tokens}
    path = write_results(args.out, "grammar_stall", rows, meta)
    print(plot(path))
    print(format_table(rows, COLUMNS + ["b_message"]))


if __name__ == "__main__":
    main()
