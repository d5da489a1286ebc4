"""The quantize stage: exported float graphs -> QDQ graphs at the config's precision
(stages/core/precision.py; w4a16-mixed by default) that the target HTP can run, audited, with a
quality report.

- onnxruntime static quantization with its QNN configuration (`get_qnn_qdq_config`): activations
  uint16, weights first int8 symmetric per output channel (an explicit axis per MatMul weight:
  onnxruntime leaves MatMul weights per-tensor otherwise), the lm_head included; then each MatMul
  weight is rewritten to the scheme its role gets (`PipelineConfig.weight_scheme`): int4 per channel
  or LPBQ, rounded by GPTQ from calibration Hessians (stages/quant/gptq.py), with a mixed precision keeping
  the weights whose 4 bits cost the most measured output error at int8 (stages/quant/sensitivity.py).
- The SoC rule for activation x activation MatMuls (Q.K^T, probs.V): without a 16x16 matmul (v69)
  the second operand, the KV cache, is 8-bit. Each owner layer's K (and V) cache input, its new
  entries, the concatenation the MatMul reads and the `xfer_kvshare_*` tensors that carry it to later parts
  get one encoding, from one calibrated range, so the runtime copies new entries into the cache
  without requantizing. SoCs with a 16x16 matmul keep KV at `kv_cache_bits`.
- The PLE policy: the in-graph per-layer-embedding paths stay float (float16 on the HTP; the default),
  or get int16 or int8 weights.
- The inputs Genie fills from host LUTs (`inputs_embeds`, `per_layer_inputs`) are read with exactly
  their LUT's encoding, whatever the PLE policy, so Genie copies LUT rows into them byte for byte
  (it has no path from a fixed-point LUT into a float input: `stages.model.encoding`). Under the float16
  policy the graph dequantizes `per_layer_inputs` right away and the PLE path after it stays float.
- Calibration (MinMax) streams graph inputs from the float chain on real text (`stages.quant.calibration`);
  AR-1 prefill graphs calibrate through their twin at `calibration_ar` (same ranges up to rounding,
  except the attention scores before the mask, which the twin's chunk widens: `twin_tensor_names`).

Every quantized graph is audited (KV and activation-matmul bit widths, the PLE policy tensor by tensor,
no float tensor left outside the PLE policy); the stage fails if an audit fails.

The package follows the stage's steps: `analysis` (what a graph holds), `calibrate` (activation ranges),
`weights` (weight schemes and rounding), `audit`, and `stage` (the stage itself).
"""

from stages.quantize.analysis import QuantizeError
from stages.quantize.stage import run_quantize

__all__ = ["QuantizeError", "run_quantize"]
