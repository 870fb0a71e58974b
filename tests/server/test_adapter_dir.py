"""--adapter-dir serves only what /v1/load_lora_adapter could load, and either reads only files
inside the directory: no symlink out of it, of a folder or of a file; an adapter that cannot be
served is refused at load (a 400 naming the problem), before its tensors are read where its
config or safetensors header already says so."""

import json
import logging

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from punica.config import EngineArgs, ModelConfig
from punica.lora.dummy import save_random_adapter
from punica.models.sources import resolve_model_dir
from punica.server.args import ServerArgs
from punica.server.serve import adapters_in, build_state

SECRET = "SECRET-TOKEN-from-outside-1234"


def adapter(path, **config):
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16} | config))
    return path


def test_a_symlink_out_of_the_adapter_dir_is_skipped_with_a_warning(tmp_path, caplog):
    root = tmp_path / "adapters"
    adapter(root / "plain")
    nested = adapter(root / "nested" / "deep")
    outside = adapter(tmp_path / "elsewhere" / "secret")
    (root / "inside-link").symlink_to(nested, target_is_directory=True)
    (root / "outside-link").symlink_to(outside, target_is_directory=True)
    (root / "dotted-link").symlink_to(root / ".." / "elsewhere" / "secret", target_is_directory=True)
    (root / "not-an-adapter").mkdir()
    with caplog.at_level(logging.WARNING, logger="punica.server"):
        found = adapters_in(root, max_rank=16)
    assert found == {"plain": str(root / "plain"), "inside-link": str(root / "inside-link")}
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "outside-link" in warned and "dotted-link" in warned and str(outside) in warned


def test_an_adapter_whose_config_links_out_of_the_adapter_dir_is_skipped_unread(tmp_path, caplog):
    root = tmp_path / "adapters"
    adapter(root / "plain")
    secret = adapter(tmp_path / "elsewhere", peft_type=SECRET)
    linked = root / "linked"
    linked.mkdir()
    (linked / "adapter_config.json").symlink_to(secret / "adapter_config.json")
    with caplog.at_level(logging.WARNING, logger="punica.server"):
        found = adapters_in(root, max_rank=16)
    assert found == {"plain": str(root / "plain")}
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "skipping adapter linked:" in warned and "adapter_config.json resolves to a file outside" in warned
    assert SECRET not in warned


def test_adapters_the_server_cannot_serve_are_skipped_with_a_warning_and_never_raise_the_rank(tmp_path, caplog):
    root = tmp_path / "adapters"
    adapter(root / "good")
    adapter(root / "nan-alpha", lora_alpha=float("nan"))
    adapter(root / "wide", r=512)
    adapter(root / "qalora", use_qalora=True)
    adapter(root / "bad name")
    (root / "unreadable").mkdir()
    (root / "unreadable" / "adapter_config.json").write_text("{")
    with caplog.at_level(logging.WARNING, logger="punica.server"):
        found = adapters_in(root, max_rank=16)
    assert found == {"good": str(root / "good")}
    warned = " ".join(r.getMessage() for r in caplog.records)
    for name in ("nan-alpha", "wide", "qalora", "bad name", "unreadable"):
        assert f"skipping adapter {name}:" in warned
    assert "rank 512 is over --max-lora-rank 16" in warned


@pytest.fixture(scope="module")
def confined(tmp_path_factory, start_server):
    """A server of the embedded model with one --adapter-dir (empty at start), and a directory outside it."""
    tmp = tmp_path_factory.mktemp("confined")
    root, outside = tmp / "adapters", tmp / "elsewhere"
    root.mkdir()
    state = build_state(EngineArgs(max_batch_size=4, max_loras=2), server=ServerArgs(adapter_dir=(str(root),)))
    running = start_server(state)
    yield running, root, outside
    running.stop()


def smol_adapter(path, **kwargs):
    config = ModelConfig.from_dir(resolve_model_dir(None))
    return save_random_adapter(path, config, rank=kwargs.pop("rank", 8), seed=0, alpha=16, **kwargs)


def load(server, name: str, path) -> httpx.Response:
    return httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                      timeout=120)


def refused(response: httpx.Response) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "lora_path"
    return error["message"]


def test_load_refuses_a_weights_file_linking_out_of_the_adapter_dir(confined):
    server, root, outside = confined
    source = smol_adapter(outside / "weights")
    path = smol_adapter(root / "linked-weights")
    (path / "adapter_model.safetensors").unlink()
    (path / "adapter_model.safetensors").symlink_to(source / "adapter_model.safetensors")
    message = refused(load(server, "linked-weights", path))
    assert "adapter_model.safetensors resolves to a file outside" in message and str(outside) not in message
    assert "linked-weights" not in httpx.get(server.url + "/v1/models").text


def test_load_refuses_a_config_linking_out_without_echoing_it(confined):
    server, root, outside = confined
    secret = adapter(outside / "secret", peft_type=SECRET)
    path = smol_adapter(root / "linked-config")
    (path / "adapter_config.json").unlink()
    (path / "adapter_config.json").symlink_to(secret / "adapter_config.json")
    message = refused(load(server, "linked-config", path))
    assert "adapter_config.json resolves to a file outside" in message and SECRET not in message


def test_load_refuses_a_rank_over_the_servers_from_the_config_before_reading_the_weights(confined):
    server, root, _ = confined
    path = smol_adapter(root / "wide", rank=32)
    weights = path / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:8 + int.from_bytes(data[:8], "little")])  # the header, no tensor data
    assert "its rank 32 is over this engine's max_lora_rank 16" in refused(load(server, "wide", path))


def test_load_refuses_a_dora_magnitude_that_would_overflow(confined):
    server, root, _ = confined
    path = smol_adapter(root / "dora-1e30", dora=True, dtype=torch.float32)
    weights = load_file(path / "adapter_model.safetensors")
    key = next(k for k in weights if k.endswith("lora_magnitude_vector"))
    weights[key][0] = 1e30
    save_file(weights, path / "adapter_model.safetensors")
    message = refused(load(server, "dora-1e30", path))
    assert f"tensor {key}: a DoRA magnitude of 1e+30, over the limit" in message
    path = smol_adapter(root / "dora-ok", dora=True, dtype=torch.float32)
    assert load(server, "dora-ok", path).status_code == 200
