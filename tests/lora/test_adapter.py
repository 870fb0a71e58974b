import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from punica.config import ModelConfig
from punica.demo import demo_adapters
from punica.lora.adapter import PROJECTIONS, load_adapter, read_adapter
from punica.lora.adapter_config import UNSUPPORTED_OPTIONS, AdapterError
from punica.lora.dummy import save_random_adapter
from punica.lora.gains import MAX_LORA_GAIN, first_gain_over_limit, lora_gain, lora_gains
from punica.lora.names import check_adapter_name
from punica.models.sources import resolve_model_dir

LAYER_MODULE = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)_proj$")


@pytest.fixture(scope="module")
def base(tiny_llama):
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def valid_dir(base, tmp_path_factory, make_peft_adapter):
    """r=8, alpha=16 on q, k and down of both layers; tests copy it before breaking it."""
    return make_peft_adapter(base, tmp_path_factory.mktemp("valid") / "ad", r=8, alpha=16,
                             targets=("q_proj", "k_proj", "down_proj"), seed=1)


def assert_matches_peft(adapter, peft_model, adapter_name, num_layers):
    """Every LoRA module PEFT built holds exactly our slice; everything else is zero or absent."""
    seen = set()
    for module_name, module in peft_model.named_modules():
        match = LAYER_MODULE.search(module_name)
        if match is None or adapter_name not in getattr(module, "lora_A", {}):
            continue
        layer, proj = int(match[1]), match[2]
        seen.add((proj, layer))
        a, b = module.lora_A[adapter_name].weight, module.lora_B[adapter_name].weight
        assert a.abs().sum() > 0 and b.abs().sum() > 0
        assert torch.equal(adapter.lora_a[proj][layer], a.detach().to(adapter.lora_a[proj].dtype))
        assert torch.equal(adapter.lora_b[proj][layer], b.detach().to(adapter.lora_b[proj].dtype))
        assert adapter.scale == pytest.approx(module.scaling[adapter_name], rel=1e-12)
    assert set(adapter.lora_a) == {proj for proj, _ in seen}
    for proj in adapter.lora_a:
        for layer in range(num_layers):
            if (proj, layer) not in seen:
                assert not adapter.lora_a[proj][layer].any() and not adapter.lora_b[proj][layer].any()


@pytest.mark.parametrize("r,alpha,targets,kw", [
    (8, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), {}),
    (4, 8, ("q_proj", "v_proj"), {"use_rslora": True}),
    (16, 7, ("o_proj", "gate_proj", "down_proj"), {}),
    (2, 2, ("k_proj", "up_proj"), {"layers_to_transform": [1]}),
    (3, 5, ("v_proj", "down_proj"), {"safe_serialization": False}),
], ids=["all-7", "rslora", "alpha!=r", "layers_to_transform", "bin"])
def test_loads_what_peft_loads(base, tmp_path, r, alpha, targets, kw, load_peft_model, make_peft_adapter,
                               punica_config):
    path = make_peft_adapter(base, tmp_path / "my-adapter", r=r, alpha=alpha, targets=targets,
                             seed=r, **kw)
    weights_file = "adapter_model.bin" if "safe_serialization" in kw else "adapter_model.safetensors"
    assert (path / weights_file).exists()
    config = punica_config(base)
    adapter = load_adapter(path, config)
    assert adapter.name == "my-adapter" and adapter.rank == r
    expected_scale = alpha / (r**0.5 if kw.get("use_rslora") else r)
    assert adapter.scale == pytest.approx(expected_scale)
    shapes = config.projection_shapes()
    for proj in adapter.lora_a:
        h_in, h_out = shapes[proj]
        assert adapter.lora_a[proj].shape == (config.num_layers, r, h_in)
        assert adapter.lora_b[proj].shape == (config.num_layers, h_out, r)
    assert list(adapter.lora_a) == [p for p in PROJECTIONS if p in adapter.lora_a]
    assert adapter.num_bytes == 4 * sum(r * sum(shapes[p]) * config.num_layers for p in adapter.lora_a)
    assert_matches_peft(adapter, load_peft_model(base, {"x": path}), "x", config.num_layers)


def test_dtype_conversion_and_name(base, valid_dir, load_peft_model, punica_config):
    adapter = load_adapter(valid_dir, punica_config(base), name="tenant-7", dtype=torch.bfloat16)
    assert adapter.name == "tenant-7"
    assert all(t.dtype == torch.bfloat16 for t in [*adapter.lora_a.values(), *adapter.lora_b.values()])
    assert adapter.num_bytes == load_adapter(valid_dir, punica_config(base)).num_bytes // 2
    assert_matches_peft(adapter, load_peft_model(base, {"y": valid_dir}), "y", 2)


def copy_of(valid_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(valid_dir, tmp_path / "ad"))


def edit_config(path: Path, **changes) -> None:
    file = path / "adapter_config.json"
    file.write_text(json.dumps(json.loads(file.read_text()) | changes))


def edit_weights(path: Path, edit) -> None:
    file = path / "adapter_model.safetensors"
    weights = load_file(file)
    edit(weights)
    save_file(weights, file)


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
DOWN_B_LAYER_1 = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"


def test_adapter_name_infix(base, valid_dir, tmp_path, load_peft_model, punica_config):
    path = copy_of(valid_dir, tmp_path)
    edit_weights(path, lambda w: w.update(
        {k.replace(".weight", ".default.weight"): w.pop(k) for k in list(w)}))
    assert ".lora_A.default.weight" in next(iter(load_file(path / "adapter_model.safetensors")))
    assert_matches_peft(load_adapter(path, punica_config(base)),
                        load_peft_model(base, {"default": valid_dir}), "default", 2)


def test_fan_in_fan_out_does_not_transpose_lora(base, valid_dir, tmp_path, load_peft_model, punica_config):
    """PEFT keeps lora_A [r, h_in] / lora_B [h_out, r] whatever fan_in_fan_out says (the flag
    describes the base layer, and PEFT resets it for nn.Linear): load exactly what PEFT loads."""
    path = copy_of(valid_dir, tmp_path)
    edit_config(path, fan_in_fan_out=True)
    with pytest.warns(UserWarning, match="fan_in_fan_out"):
        peft_model = load_peft_model(base, {"f": path})
    assert_matches_peft(load_adapter(path, punica_config(base)), peft_model, "f", 2)
    # weights saved transposed do not fit, and say so
    edit_weights(path, lambda w: w.update({Q_A: w[Q_A].T.contiguous(), Q_B: w[Q_B].T.contiguous()}))
    with pytest.raises(AdapterError, match=r"q_proj\.lora_A\.weight has rank 64, but .* r=8"):
        load_adapter(path, punica_config(base))


def remove(name):
    return lambda path: (path / name).unlink()


def write(name, data: bytes):
    return lambda path: (path / name).write_bytes(data)


def with_config(**changes):
    return lambda path: edit_config(path, **changes)


def with_weights(edit):
    return lambda path: edit_weights(path, edit)


def to_bin(path: Path) -> None:
    torch.save(load_file(path / "adapter_model.safetensors"), path / "adapter_model.bin")
    (path / "adapter_model.safetensors").unlink()


def set_tensor(key, value):
    return with_weights(lambda w: w.__setitem__(key, value))


def set_first_q_a_value(value):
    return with_weights(lambda w: w[Q_A].__setitem__((0, 0), value))


def rename(old: str, new: str):
    return with_weights(lambda w: w.update({k.replace(old, new): w.pop(k) for k in list(w) if old in k}))


LM_HEAD_A = "base_model.model.lm_head.lora_A.weight"
EMBED_A = "base_model.model.model.embed_tokens.lora_embedding_A"
NORM = "base_model.model.model.norm.weight"
ALL_TARGETS_AND_V = ["q_proj", "k_proj", "down_proj", "v_proj"]

REJECTIONS = {  # case -> (how to break the valid adapter, expected message)
    "no-dir": (shutil.rmtree, "directory not found"),
    "no-config": (remove("adapter_config.json"), "no adapter_config.json"),
    "no-weights": (remove("adapter_model.safetensors"), "no weights file"),
    "corrupt-config": (write("adapter_config.json", b'{"r": 8,'), "adapter_config.json is unreadable"),
    "config-not-object": (write("adapter_config.json", b"[8]"), "not a JSON object"),
    "corrupt-safetensors": (write("adapter_model.safetensors", b"\x00garbage" * 9),
                            "adapter_model.safetensors is unreadable"),
    "corrupt-bin": (lambda p: (to_bin(p), write("adapter_model.bin", b"garbage")(p)),
                    "adapter_model.bin is unreadable"),
    "bin-not-dict": (lambda p: (to_bin(p), torch.save([1], p / "adapter_model.bin")),
                     "adapter_model.bin does not hold a dict of named tensors"),
    "peft-type": (with_config(peft_type="IA3"), "peft_type 'IA3' is not supported"),
    "dora-without-magnitudes": (with_config(use_dora=True),
                                r"layer 0 \w+ projection has lora_A \(.*\) but no lora_magnitude_vector"),
    "magnitude-without-dora": (set_tensor(Q_A.replace("lora_A.weight", "lora_magnitude_vector"), torch.ones(64)),
                               "is a DoRA magnitude, but adapter_config.json does not set use_dora"),
    "dora-embedding": (lambda p: (edit_config(p, use_dora=True), set_tensor(EMBED_A, torch.ones(8, 128))(p)),
                       "DoRA on embeddings is not supported"),
    "target-embed": (with_config(target_modules=["q_proj", "embed_tokens"]),
                     "LoRA on embed_tokens is not supported"),
    "target-lm-head": (with_config(target_modules=".*(q_proj|lm_head)"), "LoRA on lm_head is not supported"),
    "modules-to-save": (with_config(modules_to_save=["lm_head"]), "modules_to_save .* is not supported"),
    "bias": (with_config(bias="lora_only"), "bias='lora_only' is not supported"),
    "rank-pattern": (with_config(rank_pattern={"q_proj": 4}),
                     r"rank_pattern \(per-module ranks\) is not supported"),
    "alpha-pattern": (with_config(alpha_pattern={"q_proj": 4}), r"alpha_pattern .* is not supported"),
    "bad-r": (with_config(r=0), "r=0 must be a positive integer"),
    "bool-r": (with_config(r=True), "r=True must be a positive integer"),
    "alpha-nan": (with_config(lora_alpha=float("nan")), "lora_alpha=nan must be a finite number"),
    "alpha-inf": (with_config(lora_alpha=float("-inf")), "lora_alpha=-inf must be a finite number"),
    "alpha-bool": (with_config(lora_alpha=True), "lora_alpha=True must be a finite number"),
    "alpha-string": (with_config(lora_alpha="16"), "lora_alpha='16' must be a finite number"),
    "alpha-int-beyond-float": (with_config(lora_alpha=10**400), r"lora_alpha=1000.* must be a finite number"),
    "alpha-1e300": (with_config(lora_alpha=1e300),
                    r"the scale lora_alpha / r = 1e\+300 / 8 = 1.25e\+299 is over the limit of 1e\+06"),
    "rslora-scale": (with_config(lora_alpha=-1e8, use_rslora=True),
                     r"the scale lora_alpha / sqrt\(r\) = -1e\+08 / sqrt\(8\) = -3.54e\+07 is over the limit"),
    "weights-1e30": (with_weights(lambda w: [t.fill_(1e30) for t in w.values()]),
                     (r"layer 0 q projection \(.*q_proj\.lora_A\.weight, .*q_proj\.lora_B\.weight\): the delta's "
                      r"gain \|scale\| \* \|\|B @ A\|\|_2 is 1.\d+e\+6\d, over the limit of 1000")),
    "one-layer-1e30": (with_weights(lambda w: w[DOWN_B_LAYER_1].fill_(1e30)),
                       r"layer 1 down projection .* gain .* is \d.\d+e\+3\d, over the limit"),
    "rank-differs": (with_config(r=4), r"q_proj\.lora_A\.weight has rank 8, but adapter_config.json says r=4"),
    "wrong-h-in": (set_tensor(Q_A, torch.ones(8, 65)),
                   r"shape \(8, 65\), but the base model's q projection needs \(8, 64\)"),
    "wrong-h-out": (set_tensor(Q_B, torch.ones(63, 8)),
                    r"shape \(63, 8\), but the base model's q projection needs \(64, 8\)"),
    "not-2d": (set_tensor(Q_B, torch.ones(64, 8, 1)), r"shape \(64, 8, 1\)"),
    "layer-out-of-range": (rename("layers.1.", "layers.2."),
                           "is for layer 2, but the base model has 2 layers"),
    "outside-layers-to-transform": (with_config(layers_to_transform=[1]),
                                    r"is for layer 0, outside layers_to_transform=\[1\]"),
    "a-without-b": (with_weights(lambda w: w.pop(Q_B)), r"layer 0 q projection has lora_A \(.*\) but no lora_B"),
    "b-without-a": (with_weights(lambda w: w.pop(Q_A)), r"layer 0 q projection has lora_B \(.*\) but no lora_A"),
    "duplicate": (set_tensor(Q_A.replace(".weight", ".default.weight"), torch.ones(8, 64)),
                  "are both lora_A of layer 0 q"),
    "unrecognized": (set_tensor(NORM, torch.ones(64)), f"unrecognized tensor {NORM}"),
    "unrecognized-module": (rename("self_attn.q_proj", "mlp.q_proj"), r"unrecognized tensor .*mlp\.q_proj"),
    "embedding-tensor": (set_tensor(EMBED_A, torch.ones(8, 128)), "LoRA on embeddings is not supported"),
    "lm-head-tensor": (set_tensor(LM_HEAD_A, torch.ones(8, 64)),
                       rf"LoRA on lm_head/embed_tokens is not supported \(tensor {LM_HEAD_A}\)"),
    "nan": (set_first_q_a_value(float("nan")), r"q_proj\.lora_A\.weight has non-finite values"),
    "inf": (set_first_q_a_value(float("-inf")), r"q_proj\.lora_A\.weight has non-finite values"),
    "integer": (set_tensor(Q_A, torch.ones(8, 64, dtype=torch.int32)),
                "has dtype torch.int32, not a floating-point type"),
    "target-without-weights": (with_config(target_modules=ALL_TARGETS_AND_V),
                               "target_modules names v_proj but the weights have no v tensors"),
    "no-lora-tensors": (with_weights(lambda w: w.clear()), "holds no LoRA tensors"),
}


@pytest.mark.parametrize("case", list(REJECTIONS))
def test_rejects(base, valid_dir, tmp_path, case, punica_config):
    path = copy_of(valid_dir, tmp_path)
    load_adapter(path, punica_config(base))  # valid before the edit
    breaks, message = REJECTIONS[case]
    breaks(path)
    with pytest.raises(AdapterError, match=message) as info:
        load_adapter(path, punica_config(base))
    assert str(info.value).startswith(f"LoRA adapter {path}: ")


@pytest.mark.parametrize("option", list(UNSUPPORTED_OPTIONS))
def test_rejects_unsupported_options(base, valid_dir, tmp_path, option, punica_config):
    path = copy_of(valid_dir, tmp_path)
    edit_config(path, **{option: [1]})
    message = rf"{re.escape(UNSUPPORTED_OPTIONS[option])} is not supported .*{option}=\[1\]"
    with pytest.raises(AdapterError, match=message):
        load_adapter(path, punica_config(base))


def test_rejects_overflow_on_conversion(base, valid_dir, tmp_path, punica_config):
    """A value finite in float32 but not in float16, in a row of A that B's zero column ignores
    (so the delta, and its gain, stay small)."""
    path = copy_of(valid_dir, tmp_path)
    set_first_q_a_value(1e6)(path)
    with_weights(lambda w: w[Q_B][:, 0].zero_())(path)
    load_adapter(path, punica_config(base))  # finite in float32
    with pytest.raises(AdapterError, match=r"non-finite values .* in torch.float16"):
        load_adapter(path, punica_config(base), dtype=torch.float16)


@pytest.mark.parametrize("r,h_in,h_out,scale", [(8, 64, 96, 2.0), (64, 32, 16, -0.5), (1, 5, 7, 3.0),
                                                 (16, 300, 200, 1.0)])
def test_lora_gain_is_the_spectral_norm_of_the_scaled_delta(r, h_in, h_out, scale):
    """The Gram-matrix computation equals |scale| * the largest singular value of the explicit
    product, also where h < r and for weights near float32's max (whose product float64 holds)."""
    gen = torch.Generator().manual_seed(r)
    a, b = torch.randn(r, h_in, generator=gen), torch.randn(h_out, r, generator=gen)
    for magnitude in (1.0, 1e30, 1e37):
        a_m, b_m = a * magnitude, b * magnitude  # float32, finite
        expected = abs(scale) * torch.linalg.matrix_norm(b_m.double() @ a_m.double(), ord=2)
        assert lora_gain(a_m, b_m, scale) == pytest.approx(float(expected), rel=1e-9)
    assert lora_gain(torch.zeros(r, h_in), b, scale) == 0.0


def test_the_gain_limit_is_where_it_says(base, valid_dir, tmp_path, punica_config):
    """Scaling lora_alpha moves the largest gain just under the limit (loads) or just over it (fails)."""
    config = punica_config(base)
    weights = read_adapter(valid_dir, config)
    largest = max(lora_gain(a, b, weights.scale) for _, _, a, b in weights.tensors())
    path = copy_of(valid_dir, tmp_path)
    edit_config(path, lora_alpha=16 * 0.99 * MAX_LORA_GAIN / largest)
    load_adapter(path, config)
    edit_config(path, lora_alpha=16 * 1.01 * MAX_LORA_GAIN / largest)
    with pytest.raises(AdapterError, match="over the limit of 1000"):
        load_adapter(path, config)


@pytest.mark.slow
def test_demo_and_test_adapters_are_far_below_the_gain_limit(base, tmp_path, make_peft_adapter, punica_config):
    """The adapters this project ships and tests with keep a wide margin (measured: demo adapters
    <= 3.5, random ones <= ~20); a tighter MAX_LORA_GAIN would refuse real adapters."""
    smol = ModelConfig.from_dir(resolve_model_dir(None))
    demo = list(demo_adapters().values())
    assert len(demo) == 3
    cases = [(path, smol, torch.bfloat16) for path in demo]
    cases.append((save_random_adapter(tmp_path / "random", smol, rank=8, seed=0, alpha=64), smol, torch.bfloat16))
    peft = make_peft_adapter(base, tmp_path / "peft", r=8, alpha=64, seed=3)
    cases.append((peft, punica_config(base), torch.float32))
    for path, config, dtype in cases:
        weights = read_adapter(path, config, dtype=dtype)
        largest = max(lora_gain(a, b, weights.scale) for _, _, a, b in weights.tensors())
        assert 0 < largest < MAX_LORA_GAIN / 20, path


@pytest.mark.parametrize("name", ["tenant-a", "org/adapter_v1.2", "A", "7b.q4_k", "x" * 128, "a-/b", "Org.1/x"])
def test_adapter_names_accepted(name):
    assert check_adapter_name(name) == name


@pytest.mark.parametrize("name, rule", [
    ("../x", "must start with an ASCII letter or digit"), (".hidden", "must start"), ("a b", "hold only"),
    ("", "must start"), ("x" * 10_000, "has 10000 characters, over the limit of 128"), ("x" * 129, "129 characters"),
    ("org/.x", "must start"), ("a/b/c", "one '/'"), ("/abs", "must start"), ("org/", "must start"),
    ("tenant\n", "hold only"), ("caf\u00e9", "ASCII"), ("a\\b", "hold only"),
])
def test_adapter_names_rejected(name, rule):
    with pytest.raises(ValueError, match=re.escape(rule)):
        check_adapter_name(name)


def test_fused_phi3_modules_split_into_their_projections(tmp_path, tiny_family_model, make_peft_adapter,
                                                         load_peft_model, punica_config):
    """A PEFT adapter on Phi-3's qkv_proj and gate_up_proj: each part shares lora_A and takes its rows
    of lora_B; and the same adapter read for a model without fused modules is refused."""
    phi3 = tiny_family_model("phi3")
    path = make_peft_adapter(phi3, tmp_path / "fused", r=4, alpha=8, targets=("q_proj", "gate_proj", "down_proj"))
    assert set(json.loads((path / "adapter_config.json").read_text())["target_modules"]) == {
        "qkv_proj", "gate_up_proj", "down_proj"}
    config = punica_config(phi3)
    adapter = load_adapter(path, config)
    assert list(adapter.lora_a) == ["q", "k", "v", "gate", "up", "down"]
    peft = dict(load_peft_model(phi3, {"x": path}).named_modules())
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    for layer in range(config.num_layers):
        fused = {name: peft[f"base_model.model.model.layers.{layer}.{module}"]
                 for name, module in (("qkv", "self_attn.qkv_proj"), ("gate_up", "mlp.gate_up_proj"))}
        for group, parts in (("qkv", {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}),
                             ("gate_up", {"gate": (0, inter), "up": (inter, 2 * inter)})):
            a, b = fused[group].lora_A["x"].weight, fused[group].lora_B["x"].weight
            for proj, (lo, hi) in parts.items():
                assert torch.equal(adapter.lora_a[proj][layer], a.detach())
                assert torch.equal(adapter.lora_b[proj][layer], b.detach()[lo:hi])
    llama_shaped = ModelConfig.from_hf_dict(phi3.config.to_dict() | {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "sliding_window": None})
    with pytest.raises(AdapterError, match=r"targets the fused qkv_proj, which a llama model does not have"):
        load_adapter(path, llama_shaped)


def test_batched_lora_gains_are_each_pairs_spectral_norm():
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(40, 4, 24, generator=generator), torch.randn(40, 16, 4, generator=generator)
    b[7] *= 1e30  # finite in float32, its gain far over float32's range
    gains = lora_gains(a, b, -2.0)
    assert gains.shape == (40,) and gains.dtype == torch.float64
    expected = 2.0 * torch.linalg.matrix_norm(b.double() @ a.double(), ord=2)
    torch.testing.assert_close(gains, expected, rtol=1e-9, atol=0)
    assert [lora_gain(a[i], b[i], -2.0) for i in range(40)] == pytest.approx(expected.tolist(), rel=1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_first_gain_over_the_limit_is_exact_where_the_frobenius_bound_passes_it(dtype):
    """Items whose ||A||_F ||B||_F is over the limit but whose gain is under it pass; the first item
    over it is found with its exact gain, as lora_gains finds it."""
    r, n = 4, 6
    a, b = torch.zeros(n, r, 32), torch.zeros(n, 24, r)
    for i in range(r):  # B @ A is c * d on r diagonal entries: gain c * d, the bound r * c * d
        a[:, i, i], b[:, i, i] = 2.0, 1.0
    gains = torch.tensor([0.5, 0.9, 0.5, 3.0, 0.5, 1.5]) * MAX_LORA_GAIN
    b *= (gains / 2.0).view(n, 1, 1)
    a, b = a.to(dtype), b.to(dtype)
    bounds = torch.linalg.vector_norm(a.flatten(1).double(), dim=-1) * torch.linalg.vector_norm(b.flatten(1).double(),
                                                                                                 dim=-1)
    assert (bounds > MAX_LORA_GAIN).all()
    expert, gain = first_gain_over_limit(a, b, 1.0)
    assert expert == 3 and gain == pytest.approx(float(lora_gains(a[3], b[3], 1.0)), rel=1e-12)
    assert first_gain_over_limit(a[:3], b[:3], 1.0) is None
    assert first_gain_over_limit(a[:3], b[:3], 2.0)[0] == 1  # 1.8 x the limit
    a[0] *= 1e30  # the norms overflow (bf16: both, to inf and 0): the exact gain decides
    b[0] *= 1e-30
    assert first_gain_over_limit(a[:3], b[:3], 1.0) is None
    b[0] *= 4
    expert, gain = first_gain_over_limit(a, b, 1.0)
    assert expert == 0 and gain == pytest.approx(2 * MAX_LORA_GAIN, rel=1e-2)
