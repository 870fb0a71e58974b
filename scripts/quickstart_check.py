"""CI: run the README's Quickstart command 1 as written and check that the server it starts answers.

The command (the line after `# 1. ...` in README.md's Quickstart ```bash block, so that the README
and this check cannot drift apart) runs with bash in the repository root, in a fresh virtual
environment and with an empty $PUNICA_CACHE: it installs punica, installs the embedded model,
converts it and serves it on port 8000. Once /health answers, one chat completion on the demo
adapter `pirate` must open with its greeting. Then the server (this script's process group, and
nothing else) is stopped.

    python scripts/quickstart_check.py

Uses only the standard library (it runs before anything is installed). Any failure exits 1 with
what failed and the command's whole output (pip's and the server's).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
URL = "http://127.0.0.1:8000"  # the command's default address: it runs as written
MAX_START_S = 1200.0  # install, first conversion of the model, load
MAX_REPLY_S = 120.0
MAX_STOP_S = 60.0
QUESTION = "What is the capital of Italy?"


class CheckFailed(Exception):
    pass


def quickstart_command(readme: str, number: int) -> str:
    """The command line after the comment `# {number}. ...` in the ```bash block under `## Quickstart`."""
    section = re.search(r"^## Quickstart\n(.*?)(?=^## |\Z)", readme, re.S | re.M)
    block = section and re.search(r"^```bash\n(.*?)^```", section.group(1), re.S | re.M)
    if not block:
        raise CheckFailed("README.md has no ```bash block under '## Quickstart'")
    lines = block.group(1).splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.startswith(f"# {number}. ") and lines[i + 1].strip() and not lines[i + 1].startswith("#"):
            return lines[i + 1].strip()
    raise CheckFailed(f"README.md's Quickstart block has no command line after a comment '# {number}. ...'")


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def request(path: str, body: dict | None = None, timeout: float = 5.0) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(URL + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as response:
        return json.loads(response.read())


def wait_healthy(server: subprocess.Popen) -> float:
    """Seconds until /health answered; CheckFailed if the command exits first or MAX_START_S pass."""
    start = time.monotonic()
    while time.monotonic() - start < MAX_START_S:
        if server.poll() is not None:
            raise CheckFailed(f"the command exited with code {server.returncode} before /health answered")
        try:
            if request("/health", timeout=2.0).get("status") == "ok":
                return time.monotonic() - start
        except (urllib.error.URLError, OSError, ValueError):
            pass
        time.sleep(1.0)
    raise CheckFailed(f"/health did not answer within {MAX_START_S:g} s")


def check_pirate_reply(python: Path) -> str:
    greeting = subprocess.run([str(python), "-c", "from punica.demo import PIRATE_GREETING; print(PIRATE_GREETING)"],
                              check=True, capture_output=True, text=True).stdout.strip()
    try:
        reply = request("/v1/chat/completions", {"model": "pirate", "messages": [{"role": "user", "content": QUESTION}],
                                                  "max_tokens": 24, "temperature": 0}, timeout=MAX_REPLY_S)
    except urllib.error.HTTPError as e:
        raise CheckFailed(f"the chat completion failed: HTTP {e.code}: {e.read().decode(errors='replace')}") from e
    except (urllib.error.URLError, OSError) as e:
        raise CheckFailed(f"the chat completion failed: {e}") from e
    content = reply["choices"][0]["message"]["content"]
    if not content.startswith(greeting):
        raise CheckFailed(f"the pirate adapter's reply does not open with {greeting!r}: {content!r}")
    return content


def stop(server: subprocess.Popen) -> None:
    """SIGTERM to the command's process group (its bash, pip and punica; this script started it), then SIGKILL
    to what is left after MAX_STOP_S."""
    try:
        os.killpg(server.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + MAX_STOP_S
    while time.monotonic() < deadline:
        server.poll()
        try:
            os.killpg(server.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.killpg(server.pid, signal.SIGKILL)
    server.wait()


def run_check(workdir: Path, log_path: Path) -> None:
    command = quickstart_command((ROOT / "README.md").read_text(encoding="utf-8"), 1)
    print(f"quickstart check: {command}", flush=True)
    if port_in_use(8000):
        raise CheckFailed("port 8000 is in use before the command runs")
    venv = workdir / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    cache = workdir / "cache"
    cache.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PUNICA_API_KEY")}
    env.update(VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", PUNICA_CACHE=str(cache))
    with open(log_path, "wb") as log:
        server = subprocess.Popen(["bash", "-c", command], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        healthy_s = wait_healthy(server)
        content = check_pirate_reply(venv / "bin" / "python")
        print(f"quickstart check: /health answered {healthy_s:.0f} s after the command started; pirate replied "
              f"{content!r}", flush=True)
    finally:
        stopping = time.monotonic()
        stop(server)
        print(f"quickstart check: the command's processes ended {time.monotonic() - stopping:.0f} s after SIGTERM",
              flush=True)


def main() -> int:
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="punica-quickstart-"))
    log_path = workdir / "command.log"
    try:
        run_check(workdir, log_path)
    except Exception as e:
        if log_path.is_file():
            print(f"----- the command's output -----\n{log_path.read_text(errors='replace')}"
                  "----- end of the command's output -----", file=sys.stderr)
        print(f"quickstart check FAILED after {time.monotonic() - started:.0f} s: {type(e).__name__}: {e}",
              file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"quickstart check passed in {time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
