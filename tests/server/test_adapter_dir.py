"""--adapter-dir serves only what /v1/load_lora_adapter could load: no symlink out of the folder."""

import logging

from punica.server.serve import adapters_in


def adapter(path):
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text("{}")
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
        found = adapters_in(root)
    assert found == {"plain": str(root / "plain"), "inside-link": str(root / "inside-link")}
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "outside-link" in warned and "dotted-link" in warned and str(outside) in warned
