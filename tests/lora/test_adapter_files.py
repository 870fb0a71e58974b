"""An adapter's files: inside an --adapter-dir only files inside it are read (a link out is refused
naming the file, never echoing what it leads to), and what adapter_config.json and the safetensors
header can refuse is refused before a tensor is read."""

import json
import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from punica.lora.adapter import read_adapter
from punica.lora.adapter_config import AdapterError, adapter_rank
from punica.lora.adapter_files import WeightsFile, open_confined
from punica.lora.dummy import save_random_adapter
from punica.lora.gains import MAX_LORA_GAIN

Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
MAGNITUDE = "base_model.model.model.layers.1.mlp.down_proj.lora_magnitude_vector"
SECRET = "SECRET-TOKEN-from-outside-1234"


@pytest.fixture(scope="module")
def config(tiny_llama, punica_config):
    return punica_config(tiny_llama(seed=0))


def adapter(path: Path, config, rank: int = 8, **kwargs) -> Path:
    return save_random_adapter(path, config, rank=rank, seed=0, dtype=torch.float32, **kwargs)


def move_out(file: Path, to: Path) -> Path:
    """Move `file` to the folder `to` and leave a symlink to it in its place."""
    to.mkdir(parents=True, exist_ok=True)
    target = file.rename(to / file.name)
    file.symlink_to(target)
    return target


def truncate_data(file: Path, num_bytes: int = 16) -> None:
    """Keep the safetensors header of `file` and only `num_bytes` of its tensors' data."""
    data = file.read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    file.write_bytes(data[:header_end + num_bytes])


def test_a_weights_file_linking_out_of_the_adapter_dir_is_refused(tmp_path, config):
    root = tmp_path / "adapters"
    path = adapter(root / "tenant", config)
    move_out(path / "adapter_model.safetensors", tmp_path / "elsewhere")
    read_adapter(path, config)  # outside every adapter dir (an operator's --adapter) a link is followed
    with pytest.raises(AdapterError, match=r"adapter_model.safetensors resolves to a file outside .*adapters: "
                                           r"only files inside it are read") as refused:
        read_adapter(path, config, adapter_dirs=[root])
    assert "elsewhere" not in str(refused.value)


def test_a_config_linking_out_is_refused_without_echoing_its_content(tmp_path, config):
    root = tmp_path / "adapters"
    path = adapter(root / "tenant", config)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": SECRET, "r": 8}))
    move_out(path / "adapter_config.json", tmp_path / "elsewhere")
    with pytest.raises(AdapterError, match="peft_type") as echoed:
        adapter_rank(path)  # followed where nothing confines it: the config's own field is named
    assert SECRET in str(echoed.value)
    for read in (lambda: adapter_rank(path, [root]), lambda: read_adapter(path, config, adapter_dirs=[root])):
        with pytest.raises(AdapterError, match="adapter_config.json resolves to a file outside") as refused:
            read()
        assert SECRET not in str(refused.value)


def test_links_that_stay_inside_the_adapter_dir_are_read(tmp_path, config):
    """A Hugging Face cache layout (files linking to blobs elsewhere in the directory), and a linked folder."""
    root = tmp_path / "adapters"
    path = adapter(root / "snapshots" / "abc", config)
    move_out(path / "adapter_model.safetensors", root / "blobs")
    (root / "linked").symlink_to(path, target_is_directory=True)
    expected = read_adapter(path, config)
    for folder in (path, root / "linked"):
        weights = read_adapter(folder, config, adapter_dirs=[root])
        assert all(torch.equal(a, expected.pairs[key][0]) for key, (a, _) in weights.pairs.items())


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "adapter_config.json"
    os.mkfifo(fifo)
    refused = []

    def open_it():
        try:
            open_confined(fifo, (), AdapterError)
        except AdapterError as e:
            refused.append(str(e))

    opener = threading.Thread(target=open_it, daemon=True)
    opener.start()
    opener.join(timeout=30)
    if opener.is_alive():  # blocked in open(): give it the writer it waits for, so the thread ends
        with open(fifo, "wb"):
            pass
        opener.join(timeout=30)
        pytest.fail("opening a FIFO waited for a writer")
    assert refused == ["adapter_config.json is not a regular file"]


def test_a_rank_over_the_limit_is_refused_from_the_config_before_the_weights_are_read(tmp_path, config):
    path = adapter(tmp_path / "wide", config, rank=512)
    truncate_data(path / "adapter_model.safetensors")  # reading a tensor would fail
    with pytest.raises(AdapterError, match="its rank 512 is over this engine's max_lora_rank 16 "
                                           r"\(start it with --max-lora-rank >= 512\)"):
        read_adapter(path, config, max_rank=16)


@pytest.mark.parametrize("tensor,message", [
    (torch.ones(512, 64), "has rank 512, but adapter_config.json says r=8"),
    (torch.ones(8, 65), r"has shape \(8, 65\), but the base model's q projection needs \(8, 64\)"),
    (torch.ones(8, 64, dtype=torch.int32), "has dtype torch.int32, not a floating-point type"),
])
def test_tensors_are_checked_from_the_safetensors_header_before_they_are_read(tmp_path, config, tensor, message):
    path = adapter(tmp_path / "ad", config)
    weights = load_file(path / "adapter_model.safetensors")
    weights[Q_A] = tensor
    save_file(weights, path / "adapter_model.safetensors")
    truncate_data(path / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match=rf"tensor {Q_A} {message}"):
        read_adapter(path, config)


def test_a_weights_file_larger_than_its_adapter_can_need_is_refused_unread(tmp_path, config):
    path = adapter(tmp_path / "ad", config)
    with open(path / "adapter_model.safetensors", "r+b") as f:
        f.truncate(1 << 30)  # sparse: 1 GiB for a rank-8 adapter of a hidden-64 model
    with pytest.raises(AdapterError, match=r"adapter_model.safetensors is 1073741824 bytes, more than such an "
                                           r"adapter of this model can hold \(\d+\)"):
        read_adapter(path, config)


def test_a_safetensors_header_that_claims_more_than_the_file_is_unreadable(tmp_path, config):
    path = adapter(tmp_path / "ad", config)
    data = (path / "adapter_model.safetensors").read_bytes()
    (path / "adapter_model.safetensors").write_bytes((1 << 40).to_bytes(8, "little") + data[8:])
    with pytest.raises(AdapterError, match=r"adapter_model.safetensors is unreadable: its header claims "
                                           r"1099511627776 bytes"):
        read_adapter(path, config)


def test_a_dora_magnitude_that_would_overflow_is_refused_naming_the_tensor(tmp_path, config):
    path = adapter(tmp_path / "dora", config, dora=True)
    weights = load_file(path / "adapter_model.safetensors")
    weights[MAGNITUDE][3] = 0.99 * MAX_LORA_GAIN
    save_file(weights, path / "adapter_model.safetensors")
    read_adapter(path, config)
    weights[MAGNITUDE][3] = 1e30
    save_file(weights, path / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match=rf"tensor {MAGNITUDE}: a DoRA magnitude of 1e\+30, over the limit "
                                           "of 1000"):
        read_adapter(path, config)


def safetensors_with_header(file: Path, edit) -> None:
    """Rewrite the header of the safetensors `file` in place as edit(header) makes it, keeping its data."""
    data = file.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.dumps(edit(json.loads(data[8:8 + length]))).encode()
    with open(file, "r+b") as f:  # the same file, as a writer racing a read would change it
        f.write(len(header).to_bytes(8, "little") + header + data[8 + length:])
        f.truncate()


def test_safetensors_tensors_are_read_as_safetensors_reads_them(tmp_path):
    tensors = {"odd": torch.arange(3, dtype=torch.bfloat16), "f32": torch.randn(5, 3), "empty": torch.zeros(0, 4),
               "f16": torch.randn(2, 7).half(), "i8": torch.tensor([1, -2, 3], dtype=torch.int8)}
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    with WeightsFile(tmp_path, (), 1 << 20, 1 << 16, AdapterError) as weights:
        assert weights.shapes() == {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()}
        got = weights.tensors()
    expected = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert got.keys() == expected.keys()
    for key, tensor in expected.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key


@pytest.mark.parametrize("edit,message", [
    (lambda h: h | {"b": h["b"] | {"data_offsets": h["a"]["data_offsets"]}},
     r"tensor 'b' begins at byte 0 of the data"),
    (lambda h: h | {"a": h["a"] | {"shape": [2, 4]}},
     r"tensor 'a' of shape \(2, 4\) and dtype torch.float32 has 12 bytes"),
])
def test_safetensors_whose_byte_ranges_do_not_tile_the_data_are_unreadable(tmp_path, edit, message):
    save_file({"a": torch.randn(3), "b": torch.randn(3)}, str(tmp_path / "adapter_model.safetensors"))
    safetensors_with_header(tmp_path / "adapter_model.safetensors", edit)
    with WeightsFile(tmp_path, (), 1 << 20, 1 << 16, AdapterError) as weights:
        weights.shapes()
        with pytest.raises(AdapterError, match=f"adapter_model.safetensors is unreadable: {message}"):
            weights.tensors()


def test_a_safetensors_header_changed_after_it_was_checked_is_refused(tmp_path):
    """The tensors are read at the offsets of the header that was checked, from a file still beginning with it."""
    save_file({"a": torch.randn(2, 12)}, str(tmp_path / "adapter_model.safetensors"))
    with WeightsFile(tmp_path, (), 1 << 20, 1 << 16, AdapterError) as weights:
        assert weights.shapes() == {"a": ((2, 12), torch.float32)}
        safetensors_with_header(tmp_path / "adapter_model.safetensors", lambda h: h | {"a": h["a"] | {"shape": [24]}})
        with pytest.raises(AdapterError, match="adapter_model.safetensors is unreadable: its header changed while"):
            weights.tensors()
