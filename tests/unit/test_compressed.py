"""compressed-tensors checkpoints (stages/model/compressed.py), written by the compressed-tensors
library's own ModelCompressor and read back by transformers' own loader (which decompresses through
that library): the checkpoint reader must give the float weights transformers gives, the integers and
scales as stored, and refuse a layout it cannot carry, naming it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("compressed_tensors")

from stages.model.checkpoint import Checkpoint, CheckpointError, validate_checkpoint  # noqa: E402
from stages.model.compressed import CompressedLayout, CompressedLayoutError  # noqa: E402
from stages.quant.grid import carried_grid  # noqa: E402
from stages.tools.bench import QAT_LINEARS, save_compressed_checkpoint  # noqa: E402

# Every bit width and strategy the reader takes, and a static input scale, in one checkpoint.
MIXED = (
    (r"re:.*mlp\.down_proj$", 8, "channel", None, None),
    (r"re:.*self_attn\.q_proj$", 2, "group", 16, None),
    (r"re:.*self_attn\.(k|v|o)_proj$", 4, "group", 32, 8),
    (r"re:.*mlp\.(gate|up)_proj$", 4, "channel", None, None),
)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> Path:
    return save_compressed_checkpoint(tmp_path_factory.mktemp("ct") / "mixed", "channel", MIXED)


@pytest.fixture(scope="module")
def transformers_state(mixed):
    """transformers' own reading of the checkpoint: from_pretrained, decompressed by compressed-tensors
    on the first forward call."""
    import torch
    from transformers import Gemma4ForCausalLM

    model = Gemma4ForCausalLM.from_pretrained(str(mixed), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([[2, 40, 50, 60, 70]])).logits[0].numpy()
    return model.state_dict(), logits


def test_float_weights_are_exactly_what_transformers_decompresses(mixed, transformers_state):
    state, _ = transformers_state
    ckpt = Checkpoint(mixed)
    assert len(ckpt.compressed) == 36  # every attention and MLP projection (KV-shared layers have no K, V)
    for stored in ckpt.compressed:
        ours = ckpt.tensor(stored.removeprefix(ckpt.prefix)).numpy()
        np.testing.assert_array_equal(ours, state[stored].numpy(), err_msg=stored)


def test_the_reference_model_answers_as_transformers_own_loader(mixed, transformers_state):
    from stages.model.reference import logits_of, transformers_model

    _, theirs = transformers_state
    np.testing.assert_allclose(logits_of(transformers_model(mixed), [2, 40, 50, 60, 70]), theirs, atol=1e-5)


def test_each_weight_keeps_its_stored_scheme_integers_and_scales(mixed):
    from safetensors import safe_open

    ckpt = Checkpoint(mixed)
    schemes = {n.removeprefix(ckpt.prefix).split(".", 2)[2]: g for n, g in ckpt.compressed.items()}
    assert (schemes["mlp.down_proj.weight"].bits, schemes["mlp.down_proj.weight"].strategy) == (8, "channel")
    assert (schemes["self_attn.q_proj.weight"].bits, schemes["self_attn.q_proj.weight"].group_size) == (2, 16)
    assert (
        schemes["self_attn.o_proj.weight"].input_scale and schemes["self_attn.o_proj.weight"].input_bits == 8
    )
    name = "layers.1.self_attn.q_proj.weight"
    q, scale = ckpt.weight_grid(name)
    assert q.dtype.is_signed and int(q.min()) >= -2 and int(q.max()) <= 1
    with safe_open(str(mixed / "model.safetensors"), "pt") as f:
        stored_scale = f.get_tensor("model.layers.1.self_attn.q_proj.weight_scale")
    np.testing.assert_array_equal(scale.numpy(), stored_scale.float().numpy())
    # The float weight is integer x scale exactly, so the grid comes back from it as stored.
    grid = carried_grid(ckpt.tensor(name).numpy(), scale.numpy(), 2)
    np.testing.assert_array_equal(grid.q, q.numpy())
    assert grid.max_error == 0 and grid.group == 16
    assert ckpt.input_scale("layers.1.self_attn.o_proj.weight") > 0
    assert ckpt.input_scale(name) is None


def test_download_validation_reads_the_logical_shapes(mixed):
    summary = validate_checkpoint(mixed)
    # Every tensor the tiny geometry needs, the packed Linears counted once each as X.weight.
    assert summary.text_tensors == 98 and summary.extra_text_tensors == 0 and summary.unused_tensors == ()
    assert "int2 (group, compressed-tensors)" in summary.dtypes
    assert "int8 (channel, compressed-tensors)" in summary.dtypes


def test_a_scale_that_is_not_the_weights_is_refused():
    w = np.arange(-8, 8, dtype=np.float32).reshape(2, 8) * 0.5
    with pytest.raises(ValueError, match="not its stored int4"):
        carried_grid(w, np.full((2, 1), 0.3, np.float32), 4)
    assert carried_grid(w, np.full((2, 1), 0.5, np.float32), 4).q.tolist()[0] == list(range(-8, 0))


def _config(**weights) -> dict:
    base = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**base, **weights}}},
    }


@pytest.mark.parametrize(
    "change, named",
    [
        ({"symmetric": False}, "asymmetric"),
        ({"num_bits": 3}, "3-bit"),
        ({"strategy": "tensor", "group_size": None}, "strategy 'tensor'"),
        ({"type": "float", "num_bits": 8}, "float weights"),
        ({"actorder": "group"}, r"weights\.actorder: .*actorder='group' has been removed"),
    ],
)
def test_a_layout_it_cannot_carry_is_refused_naming_it(change, named):
    with pytest.raises(CompressedLayoutError, match=named):
        CompressedLayout(_config(**change))


def test_other_formats_and_transforms_are_refused():
    with pytest.raises(CompressedLayoutError, match="format 'nvfp4-pack-quantized'"):
        CompressedLayout({**_config(), "format": "nvfp4-pack-quantized"})
    with pytest.raises(CompressedLayoutError, match="transformed"):
        CompressedLayout({**_config(), "transform_config": {"config_groups": {"u": {}}}})


def test_a_stored_weight_that_fits_no_group_is_refused_at_download(mixed, tmp_path):
    """A config that says group 64 where the file holds groups of 32: the download names the module."""
    broken = tmp_path / "broken"
    shutil.copytree(mixed, broken)
    config = json.loads((broken / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():
        if group["weights"]["group_size"] == 32:
            group["weights"]["group_size"] = 64
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(CompressedLayoutError, match=r"self_attn\.(k|v|o)_proj: its stored weight"):
        validate_checkpoint(broken)
    with pytest.raises(CheckpointError):
        Checkpoint(broken / "nothing")


def test_the_fixture_targets_every_qat_linear():
    import re

    names = [f"model.layers.{i}.{m}" for i in range(6) for m in ("self_attn.q_proj", "mlp.down_proj")]
    assert all(re.match(QAT_LINEARS[3:], n) for n in names)
    assert not re.match(QAT_LINEARS[3:], "model.layers.0.per_layer_projection")
