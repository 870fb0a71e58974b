import punica.lora.host_arena as host_arena
from punica.lora.host_arena import MIN_HOST_BYTES, host_tier_rows


def test_the_default_host_tier_holds_every_gpu_slot_at_least_4_gib_within_a_quarter_of_memory(monkeypatch, tmp_path):
    gib = 1 << 30
    monkeypatch.setattr(host_arena, "CGROUP_MEMORY_LIMITS", (tmp_path / "memory.max",))
    monkeypatch.setattr(host_arena, "NVIDIA_GPUS", tmp_path / "gpus")  # none: a CPU host
    assert host_tier_rows(3 * gib, slots=36, row_bytes=gib) == 3           # as given, whatever the slots
    assert host_tier_rows(gib // 2, slots=8, row_bytes=gib) == 1            # never none
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": (128 * gib) // 4096}   # a host of 128 GiB
    monkeypatch.setattr("os.sysconf", pages.__getitem__)
    assert host_tier_rows(None, slots=8, row_bytes=80 << 20) == MIN_HOST_BYTES // (80 << 20)  # 51 small adapters
    assert host_tier_rows(None, slots=20, row_bytes=gib) == 20              # a row for every slot
    assert host_tier_rows(None, slots=36, row_bytes=gib) == 32              # within 32 GiB
    pages["SC_PHYS_PAGES"] = (8 * gib) // 4096                              # a host of 8 GiB: 2 GiB
    assert host_tier_rows(None, slots=8, row_bytes=80 << 20) == (2 * gib) // (80 << 20)
    pages["SC_PHYS_PAGES"] = (128 * gib) // 4096
    (tmp_path / "memory.max").write_text("max\n")                          # a container without a limit
    assert host_tier_rows(None, slots=36, row_bytes=gib) == 32
    (tmp_path / "memory.max").write_text(f"{16 * gib}\n")                   # a container of 16 GiB: 4 GiB
    assert host_tier_rows(None, slots=36, row_bytes=gib) == 4
    (tmp_path / "memory.max").write_text("max\n")
    for gpu in range(8):                                                    # 8 GPUs share the 32 GiB
        (tmp_path / "gpus" / f"0000:0{gpu}:00.0").mkdir(parents=True)
    assert host_tier_rows(None, slots=36, row_bytes=gib) == 4
