"""LoRA adapters without an engine: the rank and alpha rules of each format, the checks against the
transformer, and the per-row batched delta against an independent float64 recomputation."""

import json

import pytest
import torch
from safetensors.torch import save_file

from common.diffusion.lora import LoraRows, build_adapter
from common.diffusion.lora_format import LoraConfig, LoraError, parse_state, read_lora
from common.diffusion.weights import WeightsError


def _pair(rank, inp, out, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rank, inp, generator=g), torch.randn(out, rank, generator=g)


def _state(prefix="", modules=("blocks.0.attn1.to_q",), rank=4, inp=8, out=8):
    state = {}
    for i, m in enumerate(modules):
        a, b = _pair(rank, inp, out, seed=i)
        state[f"{prefix}{m}.lora_A.weight"], state[f"{prefix}{m}.lora_B.weight"] = a, b
    return state


def test_alpha_comes_from_the_config_its_patterns_or_defaults_to_the_rank():
    state = _state(modules=("blocks.0.attn1.to_q", "blocks.0.attn1.to_k"))
    plain = parse_state(state, LoraConfig())["transformer"].modules
    assert {m: s for m, (_, _, s) in plain.items()} == {"blocks.0.attn1.to_k": 1.0, "blocks.0.attn1.to_q": 1.0}
    cfg = LoraConfig(r=4, lora_alpha=8, alpha_pattern={"to_k": 2})
    scaled = parse_state(state, cfg)["transformer"].modules
    assert scaled["blocks.0.attn1.to_q"][2] == 2.0 and scaled["blocks.0.attn1.to_k"][2] == 0.5
    rs = parse_state(state, LoraConfig(r=4, lora_alpha=8, use_rslora=True))["transformer"].modules
    assert rs["blocks.0.attn1.to_q"][2] == 4.0  # alpha / sqrt(r)
    with_key = dict(state, **{"blocks.0.attn1.to_q.alpha": torch.tensor(2.0)})
    assert parse_state(with_key, LoraConfig())["transformer"].modules["blocks.0.attn1.to_q"][2] == 0.5


@pytest.mark.parametrize("state, config, needle", [
    (_state(), LoraConfig(r=8), "config says rank 8"),
    ({**_state(), "blocks.0.attn1.to_q.lora_B.bias": torch.zeros(8)}, LoraConfig(), "not a LoRA key"),
    ({"blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 8)}, LoraConfig(), "needs both"),
    ({"m.lora_A.weight": torch.zeros(4, 8), "m.lora_B.weight": torch.zeros(8, 3)}, LoraConfig(), "low-rank pair"),
    ({"ff.conv.lora_A.weight": torch.zeros(4, 8, 1, 1), "ff.conv.lora_B.weight": torch.zeros(8, 4, 1, 1)},
     LoraConfig(), "ff.conv: .* adapt a convolution; adapters apply to Linear layers only"),
    ({}, LoraConfig(), "no tensors"),
])
def test_unusable_states_are_refused_naming_the_problem(state, config, needle):
    with pytest.raises(LoraError, match=needle):
        parse_state(state, config)


def test_peft_features_the_engine_does_not_apply_are_refused():
    for flag, needle in (("use_dora", "DoRA"), ("lora_bias", "bias")):
        with pytest.raises(LoraError, match=needle):
            LoraConfig.from_dict({"r": 4, flag: True})


def test_files_experts_metadata_and_roots(tmp_path):
    state = {**_state("transformer."), **_state("transformer_2.", modules=("blocks.1.ffn.net.2",))}
    meta = {"transformer.r": 4, "transformer.lora_alpha": 8, "transformer_2.r": 4}
    save_file(state, tmp_path / "pytorch_lora_weights.safetensors",
              metadata={"format": "pt", "lora_adapter_metadata": json.dumps(meta)})
    parsed = read_lora(str(tmp_path), [str(tmp_path)])
    assert parsed["transformer"].modules["blocks.0.attn1.to_q"][2] == 2.0  # its own expert's alpha
    assert parsed["transformer_2"].modules["blocks.1.ffn.net.2"][2] == 1.0  # no alpha for this expert
    with pytest.raises(LoraError, match="already holds transformer_2"):
        read_lora(str(tmp_path), [str(tmp_path)], swap_experts=True)
    with pytest.raises(WeightsError, match="outside the allowed"):
        read_lora(str(tmp_path), [str(tmp_path / "elsewhere")])
    peft_dir = tmp_path / "peft"
    peft_dir.mkdir()
    save_file(_state("base_model.model."), peft_dir / "adapter_model.safetensors")
    (peft_dir / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 2}))
    assert read_lora(str(peft_dir), [str(tmp_path)])["transformer"].modules["blocks.0.attn1.to_q"][2] == 0.5


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 6)
        self.norm = torch.nn.LayerNorm(8)


def test_build_adapter_checks_modules_shapes_rank_and_values():
    models = {"transformer": _Tiny()}
    ok = parse_state(_state(modules=("proj",), out=6), LoraConfig())
    adapter = build_adapter("a", 1, ok, models, max_rank=4)
    assert adapter.describe()["target_modules"] == ["proj"] and adapter.rank == 4
    cases = [
        (parse_state(_state(modules=("nope",), out=6), LoraConfig()), "unknown target module"),
        (parse_state(_state(modules=("norm",)), LoraConfig()), "not a Linear"),
        (parse_state(_state(modules=("proj",), out=7), LoraConfig()), "do not fit"),
        (parse_state(_state(modules=("proj",), out=6, rank=5), LoraConfig()), "exceeds --max-lora-rank"),
        ({"transformer_2": ok["transformer"]}, "does not have"),
    ]
    bad = parse_state(_state(modules=("proj",), out=6), LoraConfig())
    bad["transformer"].modules["proj"][1][0, 0] = float("nan")
    cases.append((bad, "non-finite"))
    for parsed, needle in cases:
        with pytest.raises(LoraError, match=needle):
            build_adapter("b", 1, parsed, models, max_rank=4)
    # sha256 covers the values: the same tensors give the same digest, others another
    assert build_adapter("c", 1, ok, models, 4).sha256 == adapter.sha256
    other = parse_state(_state(modules=("proj",), out=6, rank=3), LoraConfig())
    assert build_adapter("d", 1, other, models, 4).sha256 != adapter.sha256


def test_rows_add_each_samples_own_delta():
    model = _Tiny()
    mk = lambda seed: build_adapter(f"a{seed}", 1, parse_state(  # noqa: E731
        {"proj.lora_A.weight": _pair(3, 8, 6, seed)[0], "proj.lora_B.weight": _pair(3, 8, 6, seed)[1]},
        LoraConfig(r=3, lora_alpha=6)), {"transformer": model}, 8)
    a, b = mk(1), mk(2)
    x = torch.randn(4, 5, 8, generator=torch.Generator().manual_seed(3))
    base = model.proj(x)
    # scattered rows with different scales (gathered), and consecutive rows of one scale (a slice)
    for rows in ([(a, 1.0), None, (b, 0.5), (a, -2.0)], [(a, 0.5), (a, 0.5), None, (b, 2.0)]):
        with torch.no_grad():
            got = LoraRows(rows, x.device).add_deltas("transformer", "proj", x, base.clone())
        want = base.double().clone()
        for i, choice in enumerate(rows):
            if choice is not None:
                m = choice[0].experts["transformer"]["proj"]
                want[i] += choice[1] * m.scaling * (x[i].double() @ m.a.double().T) @ m.b.double().T
        assert (got.double() - want).abs().max() < 1e-6 * want.abs().max()  # float32 rounding
        assert torch.equal(got[rows.index(None)], base[rows.index(None)])  # a row without an adapter: untouched
    rows = [(a, 1.0), None, (b, 0.5), (a, -2.0)]
    with pytest.raises(RuntimeError, match="rows of this forward"):
        LoraRows(rows, x.device).add_deltas("transformer", "proj", x[:3], base[:3])
