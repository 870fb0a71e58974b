"""AsyncEngine and ClusterBackend both implement the server's Backend protocol: every member, with
the protocol's parameters and the same kind (method, coroutine, async generator, property)."""

import inspect

import pytest

from punica.server.async_engine import AsyncEngine
from punica.server.backend import Backend
from punica.server.cluster_backend import ClusterBackend

MEMBERS = [name for name in dir(Backend) if not name.startswith("_")]


def kind(member) -> str:
    if isinstance(member, property):
        return "property"
    if inspect.isasyncgenfunction(member):
        return "async generator"
    if inspect.iscoroutinefunction(member):
        return "coroutine"
    return "method"


def test_the_protocol_names_what_the_server_uses():
    assert {"generate", "abort", "max_model_len", "vocab_size", "has_adapter", "adapter_residency", "load_adapter",
            "unload_adapter", "set_tenants", "check_room", "num_waiting", "update_gauges", "start",
            "shutdown"} == set(MEMBERS)


@pytest.mark.parametrize("backend", [AsyncEngine, ClusterBackend])
@pytest.mark.parametrize("name", MEMBERS)
def test_backend_implements_the_member(backend, name):
    want, got = inspect.getattr_static(Backend, name), inspect.getattr_static(backend, name, None)
    assert got is not None, f"{backend.__name__} has no {name}"
    if kind(want) == "property" or kind(got) == "property":
        assert kind(got) == kind(want) == "property", name
        return
    # generate may be an async generator function or a method returning an async iterator
    assert kind(got) in ({kind(want)} | ({"async generator"} if name == "generate" else set())), name
    assert list(inspect.signature(got).parameters) == list(inspect.signature(want).parameters), name
