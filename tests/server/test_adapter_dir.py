"""--adapter-dir serves only what /v1/load_lora_adapter could load: no symlink out of the folder."""

import json
import logging

from punica.server.serve import adapters_in


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
