"""ForwardBatch: one per step, handed to every layer; each rope's cos / sin made once per batch."""

import torch

from punica.lora.batch import LoraBatch
from punica.models.forward_batch import ForwardBatch
from punica.models.loader import load_hf_dir
from punica.models.rotary import Rotary
from punica.ops.attention import AttnBatch


def test_each_rope_is_computed_once_per_batch_and_layers_share_it(tmp_path, monkeypatch, tiny_family_model):
    """Gemma 3 of 4 layers, local and global ones alternating: two ropes, two cos / sin tables per step."""
    hf = tiny_family_model("gemma3", num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2)
    hf.save_pretrained(tmp_path)
    model = load_hf_dir(tmp_path, torch.float32)
    calls, real_call = [], Rotary.__call__

    def counted(self, positions):
        calls.append(self.rope)
        return real_call(self, positions)

    monkeypatch.setattr(Rotary, "__call__", counted)
    tokens = [5, 9, 17, 3, 44, 2]
    attn = AttnBatch.build([len(tokens)], [len(tokens)], [[0, 1]], 4, 1, all_logits=True)
    batch = ForwardBatch(attn, LoraBatch.build([-1], [len(tokens)]), model.new_kv_cache(2, 4))
    with torch.no_grad():
        logits = model(torch.tensor(tokens), batch)
        expect = hf(torch.tensor([tokens])).logits[0]
    assert sorted(calls, key=lambda rope: rope.theta) == [model.config.local_rope, model.config.rope]
    torch.testing.assert_close(logits, expect, rtol=1e-4, atol=1e-4)
