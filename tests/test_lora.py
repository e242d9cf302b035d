"""LoRA adapters on tiny-random: shapes, init schemes, noise scales, and PEFT-format save/load."""
from __future__ import annotations

import json
import math

import pytest
import torch

from evolm_lib.lora import (
    ALL_PROJECTIONS,
    AdapterWeights,
    LoraSpec,
    adapter_shapes,
    base_weight_magnitudes,
    init_adapter,
    layer_of,
    load_adapter,
    module_of,
    noise_scales,
    save_adapter,
)

# tiny-random: hidden 64, intermediate 128, 2 heads of 32, 1 KV head.
TINY_OUT_IN = {
    "q_proj": (64, 64),
    "k_proj": (32, 64),
    "v_proj": (32, 64),
    "o_proj": (64, 64),
    "gate_proj": (128, 64),
    "up_proj": (128, 64),
    "down_proj": (64, 128),
}
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}


def _name(layer: int, module: str, which: str) -> str:
    parent = _PARENT.get(module, "mlp")
    return f"base_model.model.model.layers.{layer}.{parent}.{module}.lora_{which}.weight"


def test_adapter_shapes_all_projections(tiny_model_dir):
    spec = LoraSpec(rank=4)
    shapes = adapter_shapes(tiny_model_dir, spec)
    expected = {}
    for layer in (0, 1):
        for module, (out_features, in_features) in TINY_OUT_IN.items():
            expected[_name(layer, module, "A")] = (4, in_features)
            expected[_name(layer, module, "B")] = (out_features, 4)
    assert shapes == expected
    assert {layer_of(n) for n in shapes} == {0, 1}
    assert {module_of(n) for n in shapes} == set(ALL_PROJECTIONS)


def test_layers_to_transform_and_target_modules_restrict(tiny_model_dir):
    spec = LoraSpec(target_modules=("q_proj", "down_proj"), rank=2, layers_to_transform=(1,))
    shapes = adapter_shapes(tiny_model_dir, spec)
    assert shapes == {
        _name(1, "q_proj", "A"): (2, 64),
        _name(1, "q_proj", "B"): (64, 2),
        _name(1, "down_proj", "A"): (2, 128),
        _name(1, "down_proj", "B"): (64, 2),
    }


def test_missing_target_module_lists_available(tiny_model_dir):
    with pytest.raises(ValueError) as info:
        adapter_shapes(tiny_model_dir, LoraSpec(target_modules=("q_proj", "c_attn")))
    message = str(info.value)
    assert "c_attn" in message
    for module in ALL_PROJECTIONS:
        assert module in message


@pytest.mark.parametrize("layers", [(2,), (0, 5), (-1,)])
def test_bad_layer_index(tiny_model_dir, layers):
    with pytest.raises(ValueError, match="layers_to_transform"):
        adapter_shapes(tiny_model_dir, LoraSpec(layers_to_transform=layers))


@pytest.mark.parametrize("kwargs", [dict(rank=0), dict(alpha=0.0), dict(target_modules=())])
def test_spec_validation(kwargs):
    with pytest.raises(ValueError):
        LoraSpec(**kwargs)


def test_peft_default_init(tiny_model_dir):
    spec = LoraSpec(rank=8)
    shapes = adapter_shapes(tiny_model_dir, spec)
    adapter = init_adapter(spec, shapes, "peft_default", seed=3)
    assert set(adapter.tensors) == set(shapes)
    for name, tensor in adapter.tensors.items():
        assert tuple(tensor.shape) == shapes[name] and tensor.dtype == torch.float32
        if ".lora_B." in name:
            assert torch.count_nonzero(tensor) == 0
        else:
            bound = 1 / math.sqrt(shapes[name][1])
            assert tensor.abs().max() <= bound
            assert tensor.abs().max() > 0.5 * bound  # actually spread over the range, not tiny
    assert adapter.num_parameters() == sum(math.prod(s) for s in shapes.values())


def test_init_is_seeded(tiny_model_dir):
    spec = LoraSpec(rank=2)
    shapes = adapter_shapes(tiny_model_dir, spec)
    mags = base_weight_magnitudes(tiny_model_dir, spec)
    for scheme in ("peft_default", "random_ab"):
        a = init_adapter(spec, shapes, scheme, seed=7, magnitudes=mags)
        b = init_adapter(spec, shapes, scheme, seed=7, magnitudes=mags)
        c = init_adapter(spec, shapes, scheme, seed=8, magnitudes=mags)
        assert all(torch.equal(a.tensors[n], b.tensors[n]) for n in shapes)
        assert any(not torch.equal(a.tensors[n], c.tensors[n]) for n in shapes if ".lora_A." in n)
    # two same-shaped tensors do not share their draw
    a = init_adapter(spec, shapes, "peft_default", seed=7)
    assert not torch.equal(a.tensors[_name(0, "q_proj", "A")], a.tensors[_name(0, "o_proj", "A")])


def test_random_ab_std_scales_with_magnitudes():
    spec = LoraSpec(rank=64)
    name_a, name_b = _name(0, "q_proj", "A"), _name(0, "q_proj", "B")
    shapes = {name_a: (64, 2000), name_b: (2000, 64)}
    mags = {name_a: 0.02, name_b: 0.02}
    adapter = init_adapter(spec, shapes, "random_ab", seed=1, magnitudes=mags, init_scale=0.5)
    for name in shapes:
        assert adapter.tensors[name].std().item() == pytest.approx(0.5 * 0.02, rel=0.03)
        assert abs(adapter.tensors[name].mean().item()) < 0.001
    doubled = init_adapter(spec, shapes, "random_ab", seed=1, magnitudes={n: 0.04 for n in shapes}, init_scale=0.5)
    for name in shapes:  # same seed, same draw: twice the magnitude is exactly twice the tensor
        torch.testing.assert_close(doubled.tensors[name], 2 * adapter.tensors[name], rtol=1e-6, atol=0)


def test_random_ab_on_the_model_follows_layer_magnitudes(tiny_model_dir):
    spec = LoraSpec(rank=8)
    shapes = adapter_shapes(tiny_model_dir, spec)
    mags = base_weight_magnitudes(tiny_model_dir, spec)
    assert set(mags) == set(shapes) and all(m > 0 for m in mags.values())
    # initializer_range 0.2: mean |W| of a normal(0, 0.2) weight is 0.2 * sqrt(2/pi)
    assert mags[_name(0, "q_proj", "A")] == pytest.approx(0.2 * math.sqrt(2 / math.pi), rel=0.1)
    adapter = init_adapter(spec, shapes, "random_ab", seed=0, magnitudes=mags, init_scale=1.0)
    big = torch.cat([t.flatten() / mags[n] for n, t in adapter.tensors.items()])
    assert big.std().item() == pytest.approx(1.0, rel=0.05)


def test_init_errors():
    with pytest.raises(ValueError, match="scheme"):
        init_adapter(LoraSpec(), {}, "xavier")
    with pytest.raises(ValueError, match="magnitudes"):
        init_adapter(LoraSpec(), {}, "random_ab")


def test_noise_scales(tiny_model_dir):
    spec = LoraSpec(rank=1)
    shapes = adapter_shapes(tiny_model_dir, spec)
    uniform = noise_scales(shapes, 1e-3)
    assert uniform == {n: 1e-3 for n in shapes}
    mags = {n: (i + 1) * 0.1 for i, n in enumerate(shapes)}
    per_layer = noise_scales(shapes, 1e-3, "per_layer", mags)
    assert per_layer == pytest.approx({n: 1e-3 * mags[n] for n in shapes})
    real = noise_scales(shapes, 1e-3, "per_layer", base_weight_magnitudes(tiny_model_dir, spec))
    assert real[_name(0, "q_proj", "A")] == real[_name(0, "q_proj", "B")]  # A and B share the module's scale
    with pytest.raises(ValueError, match="sigma"):
        noise_scales(shapes, 0.0)
    with pytest.raises(ValueError, match="mode"):
        noise_scales(shapes, 1e-3, "per_tensor")
    with pytest.raises(ValueError, match="magnitudes"):
        noise_scales(shapes, 1e-3, "per_layer")


def _random_adapter(model_dir, spec, seed=0):
    shapes = adapter_shapes(model_dir, spec)
    gen = torch.Generator().manual_seed(seed)
    return AdapterWeights(spec, {n: torch.randn(s, generator=gen) * 0.1 for n, s in shapes.items()})


@pytest.mark.parametrize(
    "spec",
    [LoraSpec(rank=1), LoraSpec(target_modules=("v_proj", "up_proj"), rank=4, alpha=8.0, layers_to_transform=(1,))],
    ids=["all-rank1", "some-layer1"],
)
def test_save_load_round_trip_bit_exact(tmp_path, tiny_model_dir, spec):
    adapter = _random_adapter(tiny_model_dir, spec)
    folder = save_adapter(adapter, tmp_path / "adapter", base_model=str(tiny_model_dir))
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == spec.rank and config["lora_alpha"] == spec.alpha and config["peft_type"] == "LORA"
    loaded = load_adapter(folder)
    assert loaded.spec == spec
    assert loaded.tensors.keys() == adapter.tensors.keys()
    for name, tensor in adapter.tensors.items():
        assert loaded.tensors[name].dtype == torch.float32
        assert torch.equal(loaded.tensors[name], tensor)


@pytest.mark.parametrize(
    "spec",
    [LoraSpec(rank=2, alpha=4.0), LoraSpec(target_modules=("q_proj", "down_proj"), rank=1, layers_to_transform=(0,))],
    ids=["all", "layer0"],
)
def test_saved_adapter_loads_in_peft(tmp_path, tiny_model_dir, spec):
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    adapter = _random_adapter(tiny_model_dir, spec, seed=1)
    folder = save_adapter(adapter, tmp_path / "adapter", base_model=str(tiny_model_dir))
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(folder))
    state = get_peft_model_state_dict(model)
    assert state.keys() == adapter.tensors.keys()
    for name, tensor in adapter.tensors.items():
        assert torch.equal(state[name], tensor), name
    # peft applies the same scaling alpha / r
    layer = 1 if spec.layers_to_transform is None else spec.layers_to_transform[0]
    lora_module = model.base_model.model.model.layers[layer].self_attn.q_proj
    assert lora_module.scaling["default"] == pytest.approx(spec.scaling)
    # and a peft-written adapter reads back through load_adapter
    model.save_pretrained(tmp_path / "from_peft")
    again = load_adapter(tmp_path / "from_peft")
    assert again.spec.rank == spec.rank and again.spec.alpha == spec.alpha
    assert all(torch.equal(again.tensors[n], t) for n, t in adapter.tensors.items())


def test_flat_adapter_saves_and_moves_like_a_dict_of_tensors(tmp_path, tiny_model_dir):
    from evolm_lib.es import FlatParams

    adapter = _random_adapter(tiny_model_dir, LoraSpec(rank=2))
    flat = AdapterWeights(adapter.spec, FlatParams.of(adapter.tensors))  # views of one vector: shared storage
    for dtype in (torch.float32, torch.bfloat16):
        loaded = load_adapter(save_adapter(flat, tmp_path / str(dtype), dtype=dtype))
        assert loaded.tensors.keys() == adapter.tensors.keys()
        assert all(torch.equal(loaded.tensors[n], t.to(dtype).float()) for n, t in adapter.tensors.items())
    assert flat.to("cpu") is flat


def test_save_adapter_in_bfloat16(tmp_path, tiny_model_dir):
    adapter = _random_adapter(tiny_model_dir, LoraSpec(rank=1))
    loaded = load_adapter(save_adapter(adapter, tmp_path / "bf16", dtype=torch.bfloat16))
    for name, tensor in adapter.tensors.items():
        assert torch.equal(loaded.tensors[name], tensor.to(torch.bfloat16).float())


def test_noise_below_resolution_flags_sigma_within_a_few_bfloat16_ulps():
    from evolm_lib.lora import noise_below_resolution

    tensors = {"a": torch.full((4, 4), 0.04), "b": torch.zeros(4, 4), "c": torch.full((2, 2), 1.0)}
    # rms 0.04 lies in [2^-5, 2^-4): the bfloat16 ulp there is 2^-5 x 2^-7 = 2^-12 ~ 2.44e-4
    found = noise_below_resolution(tensors, {"a": 1.5e-4, "b": 1e-9, "c": 0.05}, torch.bfloat16)
    assert found == [("a", 1.5e-4, 2.0 ** -12)]  # b is all zeros (exact in any dtype); c: 0.05 > 4 x 2^-7
    assert noise_below_resolution(tensors, {"a": 1.5e-4, "b": 1e-9, "c": 1e-9}, torch.float32) == []
    assert noise_below_resolution(tensors, {"a": 4 * 2.0 ** -12, "b": 1, "c": 1}, torch.bfloat16) == []
