"""The quantization schemes: one row per precision, read by the quantize stage, its audit, the planner
and the config check (which precisions a SoC runs). The compile stage reads the weight types
from the quantized graphs themselves, never this table.

A precision says how each kind of weight is stored (bits, per output channel or in blocks along the
input dimension) and how wide activations are. The KV cache and the PLE paths have their own config
fields (kv_bits, ple_policy); the lm_head is never below 8 bits (it is the tied embedding, and the
logits are what the user sees).

4-bit schemes (docs/facts.md §4; compiled with QAIRT 2.51 for soc 36 / v69):
- int4 per output channel: DequantizeLinear on an INT4 initializer with `axis`, symmetric.
- LPBQ (low-power block quantization): INT4 weights in blocks of `block_size` input rows (a whole
  column where it is shorter), each block's scale a 4-bit integer (1..LPBQ_BLOCK_SCALE_MAX) times a
  per-output-channel float scale; in ONNX a UINT8 DequantizeLinear (per channel, axis 1) computes the
  block scales of the INT4 blockwise DequantizeLinear (axis 0, block_size). onnxruntime-qnn 2.7.0's
  QNN EP fuses it into an HTP blockwise-expansion encoding with 4-bit block scales
  (lpbqmatmul_fusion), and the v69 binary agrees with its QDQ graph in QNN's HTP emulation as closely
  as int8 does (tests/integration/test_w4a16.py).

Stdlib only: the Makefile reads the config (and so this table) before any image exists.
"""

from __future__ import annotations

from dataclasses import dataclass

# LPBQ block scales are 4-bit integers: QNN's blockwise-expansion encoding keeps them at
# blockScaleBitwidth 4. Written as 1..255 (an earlier version), the emulated test MatMul was 1763 LSB
# from its QDQ graph; within 4 bits it is as close as int8 (tests/integration/test_w4a16.py). 1..15, not
# AIMET's 1..16: both agree in QNN's emulation (5.8 and 5.9 LSB on the test MatMul, and about the same
# held-out KL on the tiny model), but 16 does not fit a 4-bit field (onnxruntime-qnn's review of its
# BQ-to-LPBQ conversion calls it an overflow), and onnxruntime's own LPBQ fusion tests draw 1..15.
LPBQ_BLOCK_SCALE_BITS = 4
LPBQ_BLOCK_SCALE_MAX = 15


@dataclass(frozen=True)
class WeightScheme:
    name: str
    bits: int
    # 0: one scale per output channel; > 0: one scale per block of this many input rows (LPBQ).
    block_size: int = 0
    # What the audit expects as the DequantizeLinear input type of a weight with this scheme.
    onnx_type: str = ""
    # Mixed precision: this share of the weights' parameters is kept at int8 instead, the weights
    # whose 4 bits cost the most output error per byte (measured by quantize on the calibration text).
    int8_share: float = 0.0

    @property
    def blockwise(self) -> bool:
        return self.block_size > 0

    @property
    def quantized(self) -> bool:
        """False for a weight kept in float (a float16 PLE path): quantize leaves it alone."""
        return not self.onnx_type.startswith("float")

    def stored_bytes(self, numel: int) -> int:
        """Bytes a weight of `numel` elements takes in a binary: the values, plus one 4-bit scale per
        block for LPBQ (per-channel float scales are a rounding error and are left out)."""
        values = (numel * self.bits + 7) // 8 + round(numel * self.int8_share * (8 - self.bits) / 8)
        if not self.blockwise:
            return values
        return values + (numel // self.block_size * LPBQ_BLOCK_SCALE_BITS + 7) // 8


INT8_CHANNEL = WeightScheme("int8-channel", 8, onnx_type="int8")
INT4_CHANNEL = WeightScheme("int4-channel", 4, onnx_type="int4")
INT4_LPBQ64 = WeightScheme("int4-lpbq64", 4, block_size=64, onnx_type="int4")
INT16_CHANNEL = WeightScheme("int16-channel", 16, onnx_type="int16")
# Kept in float: stored as 16-bit floats in a binary (the graph holds float32 until compile).
FLOAT16 = WeightScheme("float16", 16, onnx_type="float32")

# The PLE policy (config field ple_policy) -> how the in-graph per-layer-embedding paths are stored.
PLE_POLICY_SCHEMES = {"float16": FLOAT16, "int16": INT16_CHANNEL, "int8": INT8_CHANNEL}

# The roles a weight plays, each stored by its own rule (PipelineConfig.weight_scheme): the attention
# and MLP projections of every decoder layer, the tied lm_head, the PLE paths, the norms and scalars.
DECODER_ROLE, LM_HEAD_ROLE, PLE_ROLE, NORM_ROLE = "decoder", "lm_head", "ple", "norm"


@dataclass(frozen=True)
class Precision:
    name: str
    decoder_weights: WeightScheme  # attention and MLP projections of every decoder layer
    lm_head: WeightScheme
    activation_bits: int
    # 4-bit weights on the HTP (block-wise LPBQ, or int4 per channel on the same kernel) need v69+.
    needs_lpbq: bool = False
    # 16-bit weights against 16-bit activations need the v73+ 16x16 matmul.
    needs_matmul_16x16: bool = False
    # Mixed: this percent of the decoder weights' parameters stays int8 (config field int8_percent
    # overrides it; stages.core.config.decoder_scheme).
    int8_percent: int = 0
    # Why the pipeline refuses this precision; empty when it runs end to end.
    not_built: str = ""
    # 0 = most accurate. Ordered by the quality table on Gemma 3 270M's real weights under the default
    # rounding, gptq-search (docs/stages/quantize.md, "Quality on real weights"; held-out KL w8a16 0.0045,
    # w4a16-mixed 75 % 0.017, w4a16-lpbq 0.110, w4a16 0.200); the planner recommends the most accurate
    # layout that fits.
    quality_rank: int = 0

    @property
    def mixed(self) -> bool:
        return self.int8_percent > 0

    @property
    def weight_bits(self) -> int:
        return self.decoder_weights.bits

    def runs_on(self, soc) -> bool:
        return (soc.lpbq_4bit_weights or not self.needs_lpbq) and (
            soc.matmul_16x16 or not self.needs_matmul_16x16
        )


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("w8a16", INT8_CHANNEL, INT8_CHANNEL, activation_bits=16),
        # int4 per output channel: its v69 binaries agree with their QDQ graphs in QNN's HTP emulation
        # as closely as int8 (6 LSB mean on a test MatMul).
        Precision("w4a16", INT4_CHANNEL, INT8_CHANNEL, activation_bits=16, needs_lpbq=True, quality_rank=3),
        Precision(
            "w4a16-mixed",
            INT4_CHANNEL,
            INT8_CHANNEL,
            activation_bits=16,
            needs_lpbq=True,
            # 75 %: the largest quarter step at which the default E2B bundle stays under the 8 GB
            # phone's ~5 GiB (4.89 GiB pinned; 90 % is over: `make plan`, a unit test checks it).
            int8_percent=75,
            quality_rank=1,
        ),
        # LPBQ: its v69 binaries agree as closely (6 LSB). Level with w4a16 on the tiny model, where a
        # 64-row block is a whole column for most weights (KL 0.072 against 0.076), but on real weights
        # (270M: 10 blocks per column at hidden 640, 26-32 at E2B's 1536) it halves int4 per channel's
        # KL (0.110 against 0.200 under gptq-search; 0.63 against 1.98 rounded to nearest): one better.
        Precision(
            "w4a16-lpbq", INT4_LPBQ64, INT8_CHANNEL, activation_bits=16, needs_lpbq=True, quality_rank=2
        ),
        Precision(
            "w16a16",
            INT16_CHANNEL,
            INT16_CHANNEL,
            activation_bits=16,
            needs_matmul_16x16=True,
            quality_rank=-1,
            not_built="the quantize stage has no 16-bit weight scheme yet (use w8a16)",
        ),
    )
}


def usable_precisions(soc) -> list[Precision]:
    """The precisions the pipeline builds end to end and `soc` runs, in table order."""
    return [p for p in PRECISIONS.values() if not p.not_built and p.runs_on(soc)]
