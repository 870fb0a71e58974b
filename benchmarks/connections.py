"""Connections: does `punica serve` keep answering while clients hold tens of thousands of idle connections?

    python -m benchmarks.connections [--connections 21000] [--client-addresses 1 64] [--server-nofile N]
                                     [--serve-args "..."] [--out results/connections]

Starts `punica serve` (the embedded SmolLM2 model on CPU; --serve-args go to it) with the limit on
open files this process has (or --server-nofile, soft and hard). Then, once per --client-addresses
scenario, opens --connections raw connections from that many local addresses (127.0.x.y, in
turn; from client processes, each with its limit on open files raised to its hard one, as many
processes as the connections take), each sending half a request head and nothing more, the way a
slowloris client does. Every --probe-every connections, and 20 times once all are open, /health
is asked from a new connection from 127.0.0.1 (each probe gives up after 5 s). Reports /health's
latency, how many of the idle connections the server still holds at the end (it closes the idle
ones past --max-connections, or --max-connections-per-client from one address, and each at
--header-timeout), and how much the server's log grew.

Checks, each a failure (exit code 1) when broken, in each scenario: every probe answered 200 (a 503
means the server had no room: all the connections it holds were idle for under a second), those
once all connections are open within a second, and the log grew by less than 1 MB. Reported, not
judged: the probes' latency while the connections are opened (a flood as fast as the client
processes go, on the same machine), and the server's CPU time. Writes connections.json and connections.png
under --out and prints a summary last.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import selectors
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from benchmarks.common import save_figure, write_results
from benchmarks.served import free_port

HEALTH_S = 1.0
PROBE_TIMEOUT_S = 5.0
MAX_LOG_GROWTH_BYTES = 1 << 20
PARTIAL_HEAD = b"GET /health HTTP/1.1\r\nHost: x\r\n"  # the blank line that would end it never comes


def probe(url: str) -> dict:
    """/health from a new connection: {"health_s": seconds it took, "health": "200", another status
    (503: no room for the connection), "timeout" (none within PROBE_TIMEOUT_S) or the error's name}."""
    start = time.perf_counter()
    try:
        outcome = str(httpx.get(url, timeout=PROBE_TIMEOUT_S).status_code)
    except httpx.TimeoutException:
        outcome = "timeout"
    except httpx.HTTPError as e:
        outcome = type(e).__name__
    return {"health_s": time.perf_counter() - start, "health": outcome}


def num_per_process(num_connections: int) -> list[int]:
    """The connections each client process opens: as many as its limit on open files holds (raised
    to the hard limit), in as few processes as that takes."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = (1 << 20 if hard == resource.RLIM_INFINITY else hard) - 256
    num_processes = -(-num_connections // room)
    return [num_connections // num_processes + (i < num_connections % num_processes) for i in range(num_processes)]


def hold(port: int, addresses: list[str], opened, release, held) -> None:
    """In a client process: open an idle connection from each of `addresses` (local 127.x.y.z ones),
    count them in `opened`, keep them until `release`, then put how many the server has not closed on `held`."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    socks = []
    for address in addresses:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(address, 0))
        sock.sendall(PARTIAL_HEAD)
        socks.append(sock)
        with opened.get_lock():
            opened.value += 1
    release.wait()
    with selectors.DefaultSelector() as selector:  # one the server closed is readable (EOF)
        for sock in socks:
            selector.register(sock, selectors.EVENT_READ)
        held.put(len(socks) - len(selector.select(timeout=0)))
    for sock in socks:
        sock.close()


def flood(port: int, url: str, num_connections: int, num_addresses: int, probe_every: int) -> tuple[list[dict], dict]:
    """Open the idle connections (from 127.0.0.2 on, `num_addresses` of them in turn) and probe
    /health (from 127.0.0.1) while they are opened and once they all are."""
    addresses = [f"127.0.{1 + i // 250}.{2 + i % 250}" for i in range(num_addresses)]
    opened, release, held = multiprocessing.Value("i", 0), multiprocessing.Event(), multiprocessing.Queue()
    shares = num_per_process(num_connections)
    turns = [[addresses[i % num_addresses] for i in range(sum(shares[:k]), sum(shares[:k + 1]))]
             for k in range(len(shares))]
    clients = [multiprocessing.Process(target=hold, args=(port, turn, opened, release, held)) for turn in turns]
    rows = []
    start = time.monotonic()
    try:
        for client in clients:
            client.start()
        next_probe = probe_every
        while opened.value < num_connections:
            if not all(c.is_alive() for c in clients):
                raise RuntimeError("a client process failed while opening its connections")
            if opened.value >= next_probe:
                rows.append({"connections_opened": opened.value, "t_s": time.monotonic() - start, **probe(url)})
                next_probe += probe_every
            time.sleep(0.01)
        ramp_s = time.monotonic() - start
        for _ in range(20):
            rows.append({"connections_opened": num_connections, "t_s": time.monotonic() - start, **probe(url)})
        release.set()
        num_held = sum(held.get(timeout=60) for _ in clients)
    finally:
        release.set()
        for client in clients:
            client.join(60)
    ramp, end = ([r for r in rows if (r["connections_opened"] < num_connections) == during] for during in (True, False))
    summary = {"client_addresses": num_addresses, "client_processes": len(clients), "ramp_s": round(ramp_s, 1),
               "held_by_server_at_end": num_held, **latency_summary("health_during_ramp", ramp),
               **latency_summary("health_at_end", end)}
    return rows, summary


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def latency_summary(name: str, probes: list[dict]) -> dict:
    answered = sorted(p["health_s"] for p in probes if p["health"] == "200")
    return {f"{name}_probes": len(probes),
            f"{name}_unanswered": dict(Counter(p["health"] for p in probes if p["health"] != "200")),
            f"{name}_median_s": round(answered[len(answered) // 2], 3) if answered else None,
            f"{name}_max_s": round(answered[-1], 3) if answered else None}


def run(args: argparse.Namespace, log_path: Path) -> tuple[list[dict], dict]:
    server_limits = ((args.server_nofile, args.server_nofile) if args.server_nofile
                     else resource.getrlimit(resource.RLIMIT_NOFILE))
    port = free_port()
    url = f"http://127.0.0.1:{port}/health"
    command = [sys.executable, "-m", "punica.cli", "serve", "--port", str(port), *args.serve_args.split()]
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                  preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, server_limits))
    try:
        deadline = time.monotonic() + 300
        while probe(url)["health"] != "200":
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        rows, scenarios = [], []
        for num_addresses in args.client_addresses:
            log_at_start, cpu_at_start = log_path.stat().st_size, cpu_seconds(server.pid)
            scenario_rows, summary = flood(port, url, args.connections, num_addresses, args.probe_every)
            summary["server_cpu_s"] = round(cpu_seconds(server.pid) - cpu_at_start, 2)
            rows += [{"client_addresses": num_addresses, **row} for row in scenario_rows]
            summary["log_growth_bytes"] = log_path.stat().st_size - log_at_start
            summary["log_lines"] = [line for line in log_path.read_bytes()[log_at_start:].decode(errors="replace")
                                    .splitlines() if "GET /health" not in line][-8:]
            scenarios.append(summary)
            time.sleep(1)  # the server closes the released connections
        server_alive = server.poll() is None
    finally:
        server.terminate()
        server.wait(60)
    return rows, {"connections": args.connections, "server_nofile": list(server_limits),
                  "server_alive": server_alive, "scenarios": scenarios}


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for num_addresses in sorted({r["client_addresses"] for r in rows}):
        mine = [r for r in rows if r["client_addresses"] == num_addresses]
        answered = [r for r in mine if r["health"] == "200"]
        failed = [r for r in mine if r["health"] != "200"]
        line, = ax.plot([r["t_s"] for r in answered], [r["health_s"] * 1e3 for r in answered], ".", ms=4,
                        label=f"from {num_addresses} addresses")
        if failed:
            ax.plot([r["t_s"] for r in failed], [r["health_s"] * 1e3 for r in failed], "x", ms=5,
                    color=line.get_color(), label=f"not 200 ({num_addresses} addresses)")
    ax.axhline(HEALTH_S * 1e3, color="gray", lw=0.8, ls="--")
    ax.set_yscale("log")
    ax.set_xlabel("seconds since the first idle connection", fontsize=8)
    ax.set_ylabel("/health latency (ms)", fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    save_figure(fig, path, title)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=21000, help="idle connections to open")
    parser.add_argument("--client-addresses", type=int, nargs="+", default=[1, 64],
                        help="scenarios: how many client addresses (127.0.x.y) the connections come from")
    parser.add_argument("--probe-every", type=int, default=1000, help="connections opened between /health probes")
    parser.add_argument("--server-nofile", type=int, default=None,
                        help="the server's limit on open files, soft and hard (default: this process's)")
    parser.add_argument("--serve-args", default="--max-batch-size 4 --kv-cache-tokens 4096",
                        help="extra flags of `punica serve`")
    parser.add_argument("--out", type=Path, default=Path("results/connections"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows, summary = run(args, Path(tmp) / "server.log")
    failures = []
    for scenario in summary["scenarios"]:
        unanswered = sum(scenario["health_during_ramp_unanswered"].values()) + sum(
            scenario["health_at_end_unanswered"].values())
        slowest = scenario["health_at_end_max_s"]
        if unanswered or (slowest or 0) > HEALTH_S:
            failures.append(f"{scenario['client_addresses']} addresses: {unanswered} /health probes not answered "
                            f"200; once all connections were open, the slowest took {slowest} s (must be within "
                            f"{HEALTH_S} s)")
        if scenario["log_growth_bytes"] >= MAX_LOG_GROWTH_BYTES:
            failures.append(f"{scenario['client_addresses']} addresses: the log grew by "
                            f"{scenario['log_growth_bytes']} bytes")
    if not summary["server_alive"]:
        failures.append("the server exited")
    summary["failures"] = failures
    meta = {"date": time.strftime("%Y-%m-%d"), "device": "cpu", "serve_args": args.serve_args, "summary": summary}
    write_results(args.out, "connections", rows, meta)
    plot(rows, args.out / "connections.png", f"/health while {args.connections} idle connections are opened")
    print(json.dumps(summary, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
