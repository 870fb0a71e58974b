"""benchmarks.moe_gemm on the CPU: its correctness-only smoke run on tiny-moe checks every variant against
the float32 reference and counts the bytes each reads; the reference catches a wrong routing; a preset
without experts and a non-positive token count are refused."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import benchmarks.moe_gemm as moe_gemm
from punica.config import preset_config

REPO = Path(__file__).parents[2]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.moe_gemm", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_the_smoke_run_checks_every_variant_and_counts_what_it_reads(tmp_path):
    done = run("--preset", "tiny-moe", "--tokens", "1", "3", "16", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "moe_gemm.json").read_text())["rows"]
    assert [(r["variant"], r["tokens"]) for r in rows] == [(v, t) for t in (1, 3, 16) for v in moe_gemm.VARIANTS]
    c = preset_config("tiny-moe")
    for r in rows:
        assert r["rel_error"] <= moe_gemm.MAX_REL_ERROR, r
        assert 1 <= r["active_experts"] <= min(c.num_experts, r["tokens"] * c.num_experts_per_tok)
        base = r["active_experts"] * moe_gemm.expert_bytes(c)
        if r["variant"] == "lora":  # every token its own slot: each (token, expert) pair its own A and B
            assert r["active_lora_pairs"] == r["tokens"] * c.num_experts_per_tok
            assert r["bytes"] == base + r["active_lora_pairs"] * moe_gemm.lora_pair_bytes(c)
        else:
            assert r["bytes"] == base
    assert [r["active_experts"] for r in rows if r["tokens"] == 1] == [c.num_experts_per_tok] * 3
    header = done.stdout.splitlines()[-len(rows) - 2]  # the table comes last
    assert header.split(" | ") == ["variant", "tokens", "active_experts", "rel_error"]


def test_the_reference_catches_a_wrong_routing(monkeypatch):
    c = preset_config("tiny-moe")
    torch.manual_seed(0)
    lora = moe_gemm.make_lora(c, 8, torch.device("cpu"))
    layers = [moe_gemm.make_layer(c, lora, torch.device("cpu"))]
    route = moe_gemm.route
    monkeypatch.setattr(moe_gemm, "route", lambda logits, top_k, renormalize: route(-logits, top_k, renormalize))
    with torch.inference_mode():
        rows = moe_gemm.measure(c, 8, layers, 8, 0, None, torch.device("cpu"))
    errors = {r["variant"]: r["rel_error"] for r in rows}
    assert errors["block"] > 10 * moe_gemm.MAX_REL_ERROR and errors["lora"] > 10 * moe_gemm.MAX_REL_ERROR


@pytest.mark.parametrize(("args", "message"), [(("--preset", "tiny"), "invalid choice: 'tiny'"),
                                               (("--preset", "tiny-moe", "--tokens", "0"), "must be positive")])
def test_bad_arguments_are_refused(args, message):
    done = run(*args)
    assert done.returncode == 2 and message in done.stderr, done.stderr
