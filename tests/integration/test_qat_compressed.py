"""A compressed-tensors QAT checkpoint (Google's `-ct` layout at toy size, written by that library's own
ModelCompressor from the tiny QAT fixtures) imported as a user imports a folder, through export and
quantize: every stored 4-bit (and 2-bit) weight comes out with the checkpoint's own integers, compared
here with the library's own unpacking of the file; an 8-bit one stays int8; static input scales are
reported beside the calibrated ranges; and the bundle answers under the real Genie as transformers
answers on that checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("compressed_tensors")

from stages.core.config import load_config  # noqa: E402
from stages.tools.bench import save_compressed_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow
PROMPT = "Return the first element of a list."


def _quantized(work: Path, kind: str, overrides: dict, schemes=None) -> tuple[dict, Path]:
    from stages.download import run_download
    from stages.export import run_export
    from stages.quantize import run_quantize

    model = f"tiny-qat-{kind}"
    ckpt = work / "checkpoints" / model
    if not ckpt.is_dir():
        run_download(model, "main", ckpt, from_dir=save_compressed_checkpoint(work / "src", kind, schemes))
    for stage in ("exported", "quantized"):
        shutil.rmtree(work / stage, ignore_errors=True)
    cfg = load_config("tiny", {"model": model, **overrides})
    run_export(cfg, work, ckpt)
    return run_quantize(cfg, work, ckpt)["figures"], ckpt


def _stored_integers(ckpt: Path, weight: str) -> tuple[np.ndarray, np.ndarray]:
    """(integers (in, out), scales (out, groups)) of a weight, by compressed-tensors' own unpacking."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors import safe_open

    module = "model." + weight.removesuffix(".weight")
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        shape = torch.Size(f.get_tensor(module + ".weight_shape").tolist())
        bits = 32 * f.get_slice(module + ".weight_packed").get_shape()[1] // shape[1]
        q = unpack_from_int32(f.get_tensor(module + ".weight_packed"), bits, shape)
        return q.numpy().T, f.get_tensor(module + ".weight_scale").float().numpy()


def _graph_weights(work: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every int4 weight of the quantized graphs: name -> (integers (in, out), its DequantizeLinear's
    scale initializer)."""
    import onnx
    from onnx import numpy_helper

    out = {}
    for path in sorted((work / "quantized").glob("*.onnx")):
        graph = onnx.load(str(path), load_external_data=False).graph
        inits = {i.name: i for i in graph.initializer}
        for node in graph.node:
            if node.op_type == "DequantizeLinear" and node.input[0].endswith("_quantized"):
                q = inits.get(node.input[0])
                if q is not None and q.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.INT8):
                    scale = inits.get(node.input[1])
                    out[node.input[0].removesuffix("_quantized")] = (
                        numpy_helper.to_array(q).astype(np.int8),
                        numpy_helper.to_array(scale) if scale is not None else None,
                    )
    return out


def test_a_channel_grid_is_kept_bit_exact_integers_and_scales(tmp_path):
    fig, ckpt = _quantized(tmp_path, "channel", {"precision": "w4a16"})
    grids = fig["weights"]["checkpoint_grids"]
    assert grids["kept"] == grids["found"] == grids["of"] == 36
    assert {g["source"] for g in grids["weights"].values()} == {"compressed-tensors"}
    stored = _graph_weights(tmp_path)
    for name in grids["weights"]:
        q, scale = _stored_integers(ckpt, name)
        np.testing.assert_array_equal(stored[name][0], q, err_msg=name)
        np.testing.assert_array_equal(stored[name][1], scale[:, 0], err_msg=name)
    assert all(graph["audit"]["problems"] == [] for graph in fig["graphs"])


def test_a_group_grid_keeps_every_integer_as_lpbq_blocks_of_32(tmp_path):
    fig, ckpt = _quantized(tmp_path, "group32", {"precision": "w4a16-lpbq"})
    grids = fig["weights"]["checkpoint_grids"]
    assert grids["kept"] == 36 and all(g["scale_residual"] < 0.05 for g in grids["weights"].values())
    stored = _graph_weights(tmp_path)
    for name in grids["weights"]:
        np.testing.assert_array_equal(stored[name][0], _stored_integers(ckpt, name)[0], err_msg=name)
    audited = [w for graph in fig["graphs"] for w in graph["audit"]["weights"] if w.get("checkpoint_grid")]
    assert audited and all(w["block_size"] == 32 for w in audited)


MIXED = (
    (r"re:.*mlp\.down_proj$", 8, "channel", None, None),
    (r"re:.*self_attn\.q_proj$", 2, "channel", None, None),
    (r"re:.*self_attn\.(k|v|o)_proj$", 4, "channel", None, 8),
    (r"re:.*mlp\.(gate|up)_proj$", 4, "channel", None, None),
)


def test_8_bit_weights_stay_int8_2_bit_ones_are_kept_and_static_scales_are_reported(tmp_path):
    fig, ckpt = _quantized(tmp_path, "channel", {"precision": "w4a16"}, MIXED)
    weights = fig["weights"]
    down = sorted(n for n in weights["checkpoint_grids"]["weights"] if n.endswith("down_proj.weight"))
    assert down and weights["int8_weights"] == down
    assert all(not weights["checkpoint_grids"]["weights"][n]["kept"] for n in down)
    stored = _graph_weights(tmp_path)
    q_proj = [n for n in weights["checkpoint_grids"]["weights"] if n.endswith("q_proj.weight")]
    for name in q_proj:
        q, _ = _stored_integers(ckpt, name)
        assert q.min() >= -2 and q.max() <= 1
        np.testing.assert_array_equal(stored[name][0], q, err_msg=name)
    static = weights["checkpoint_grids"]["static_input_scales"]
    assert static and all(n.split(".")[-2] in ("k_proj", "v_proj", "o_proj") for n in static)
    for entry in static.values():
        assert entry["used"] == "calibrated" and entry["checkpoint"][0] < 0 < entry["checkpoint"][1]
    audited = {w["weight"]: w for graph in fig["graphs"] for w in graph["audit"]["weights"]}
    assert all(audited[n]["type"] == "int8" for n in down)
    assert all(graph["audit"]["problems"] == [] for graph in fig["graphs"])


def test_the_bundle_answers_as_transformers_on_the_compressed_checkpoint(tmp_path):
    from stages.compile import run_compile
    from stages.runtimes.genie.bundle import run_bundle
    from stages.runtimes.genie.verify import run_verify

    _, ckpt = _quantized(tmp_path, "channel", {"precision": "w4a16"})
    cfg = load_config("tiny", {"model": "tiny-qat-channel", "precision": "w4a16"})
    run_compile(cfg, tmp_path)
    run_bundle(cfg, tmp_path, ckpt)
    fig = run_verify(cfg, tmp_path, ckpt, PROMPT)["figures"]
    assert all(status >= 0 for status in fig["real_genie"]["statuses"].values())
    assert fig["real_genie"]["answers"]["chat"][:8] == fig["transformers_text"][:8]
