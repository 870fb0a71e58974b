import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from punica.config import EngineArgs
from punica.lora.dummy import save_random_adapter
from punica.server.app import ServerState, build_app
from punica.server.args import DEFAULT_MAX_REQUEST_BYTES
from punica.server.serve import build_state


def free_port() -> int:
    """A port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    """A punica server on a free 127.0.0.1 port, in a thread of this process. Tests get theirs
    from the `start_server` fixture, which stops it at the end of the session if the test did not."""

    def __init__(self, state, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, server_class=uvicorn.Server,
                 **server_kwargs):
        self.state = state
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(build_app(state, max_request_bytes), host="127.0.0.1", port=self.port,
                                log_level="warning")
        self.server = server_class(config, **server_kwargs)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 600  # a bound, not a timing: Ray workers start slowly on a loaded machine
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                self.stop()
                raise RuntimeError("the test server did not start")
            time.sleep(0.05)

    @property
    def engine(self):
        return self.state.backend.engine

    def wait_idle(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self) -> None:
        """Shut the server down (and with it the engine thread), then let go of its backend;
        stopping a stopped server does nothing. FastAPI keeps the endpoint functions of every app
        it has built in module-level caches for the life of the process, and build_app's
        endpoints hold the state: without this, each stopped server's engine (model, KV cache)
        stayed in the test process."""
        self.server.should_exit = True  # the app's lifespan shuts the engine thread down
        self.thread.join(timeout=30)
        if not self.thread.is_alive():
            self.state.backend = None


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items):
    """The server tests run one after another in one pytest-xdist worker (`--dist loadgroup`): each
    module's server holds a model and a 1 GiB KV cache beside the session's shared one, and two
    workers' servers at once outgrew a 24 GiB machine. Those on Ray keep the Ray group."""
    for item in items:
        if item.path.parent.name == "server" and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group("server"))


@pytest.fixture(scope="session", name="free_port")
def free_port_fixture():
    """The function `free_port() -> int`."""
    return free_port


def read_answer(sock: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of the next answer on a connection kept open: read up to its Content-Length."""
    raw = b""
    while b"\r\n\r\n" not in raw:
        raw += sock.recv(65536)
    head, _, body = raw.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1]), json.loads(body)


@pytest.fixture(scope="session", name="read_answer")
def read_answer_fixture():
    """The function `read_answer(sock) -> (status, JSON body)`."""
    return read_answer


@pytest.fixture(scope="session")
def start_server():
    """The function `start_server(state, **kwargs) -> RunningServer` (kwargs: RunningServer's
    max_request_bytes, server_class and what goes to server_class): a server of `state` on a free
    127.0.0.1 port. A test may stop its server early with `.stop()`; every server started here
    that is still running is stopped at the end of the session."""
    started = []

    def start(state, **kwargs) -> RunningServer:
        # let go of the stopped ones: each holds its engine (model, KV cache) for as long as it is listed
        started[:] = [running for running in started if running.thread.is_alive()]
        started.append(RunningServer(state, **kwargs))
        return started[-1]

    yield start
    for running in started:
        running.stop()


@pytest.fixture(scope="session")
def adapter_dirs(tmp_path_factory):
    """Three served adapters, plus a directory of loadable ones (for /v1/load_lora_adapter)."""
    from punica.config import ModelConfig
    from punica.models.sources import resolve_model_dir

    config = ModelConfig.from_dir(resolve_model_dir(None))
    root = tmp_path_factory.mktemp("adapters")
    served = {f"tenant-{i}": str(save_random_adapter(root / "served" / f"tenant-{i}", config, rank=8, seed=i,
                                                      alpha=64)) for i in range(3)}
    for i in range(2):
        save_random_adapter(root / "loadable" / f"extra-{i}", config, rank=4, seed=10 + i, alpha=32)
    return served, root / "loadable"


@pytest.fixture(scope="module")
def private_dir(tmp_path_factory):
    """An adapter directory of one test module's own server alone, for the broken adapters its tests write."""
    return tmp_path_factory.mktemp("private-adapters")


@pytest.fixture(scope="session")
def server(adapter_dirs, start_server):
    """The server of the session, shared by every module that asks for it: a test that changes
    its state (API key, queue limit, loaded adapters, the engine) uses a server of its own."""
    served, loadable = adapter_dirs
    state = build_state(EngineArgs(max_batch_size=16, max_loras=4), adapters=served)
    state.adapter_dirs = [loadable]
    return start_server(state)


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


class StubBackend:
    """What the HTTP layer asks of a backend before a request reaches the engine, for tests of
    that layer alone: there is no model, and `generate` is not there."""

    def __init__(self, max_model_len: int = 2048, adapters: dict[str, str] | None = None, vocab_size: int = 49152):
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self.adapters = dict(adapters or {})

    def has_adapter(self, name: str) -> bool:
        return name in self.adapters

    async def adapter_residency(self) -> dict:
        """Adapters that never left the disk."""
        return {"object": "list", "data": [{"id": name, "object": "adapter", "path": path, "tier": "disk"}
                                           for name, path in sorted(self.adapters.items())]}

    def num_waiting(self) -> int:
        return 0

    def check_room(self, tenant: str | None, adapter: str | None) -> None:
        """Every tenant has room."""

    async def start(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    from punica.models.sources import resolve_model_dir

    return AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))


def stub_state(tokenizer, **kwargs) -> ServerState:
    """A ServerState over a StubBackend whose base model is named "base"."""
    backend_kwargs = {k: kwargs.pop(k) for k in ("max_model_len", "adapters") if k in kwargs}
    return ServerState(StubBackend(**backend_kwargs), tokenizer, "base", **kwargs)


@pytest.fixture(scope="session", name="stub_state")
def stub_state_fixture():
    """The function `stub_state(tokenizer, **kwargs) -> ServerState` (kwargs: StubBackend's
    max_model_len and adapters, and ServerState's)."""
    return stub_state
