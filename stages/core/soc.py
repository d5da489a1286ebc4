"""The SoC table: the one place that states what each Snapdragon target can do.

soc_model, dsp_arch and VTCM as in ExecuTorch's QNN backend (qc_schema.py _soc_info_table); AI Hub
device names and chipset attributes as in qai-hub-models' device registry; weight sharing from
v73 (qai-hub-models refuses it below hexagon 73). 16x16 activation matmul on v69 is documented as
unsupported in docs/facts.md §2 but not confirmed by a Qualcomm document.

Memory limits (docs/facts.md §2; every figure carries its source in the row): the context-binary generator's
per-context estimated-allocation limit, the address space of one DSP process domain, and for each phone
class a SoC ships in, the RAM a bundle may pin.

HTP peak throughput (the plan's compute roofline) where a figure can be reached at all, marked as an
estimate with how it was reached; rows without one are priced on memory bandwidth alone.

Templates, the config validator, the planner and the compile rules check read these rows; nothing
else may hard-code a soc_model, an HTP architecture, a capability, a memory limit or a peak figure.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class HtpCompute:
    """Peak matrix throughput of the HTP, in tera-operations per second (one multiply-accumulate is
    two operations), for the activation widths the graphs use. Qualcomm publishes no per-HTP figure
    for most parts: `estimate` says the numbers are ours, and `source` how they were reached."""

    int8_tops: float  # 8-bit activations x 8-bit weights, dense
    a16_tops: float  # 16-bit activations x 8-bit (or unpacked 4-bit) weights: what w*a16 graphs run
    source: str
    estimate: bool = True

    def ops_per_s(self, activation_bits: int) -> float:
        return (self.int8_tops if activation_bits <= 8 else self.a16_tops) * 1e12


@dataclass(frozen=True)
class MemoryBandwidth:
    gb_per_s: float
    dram: str
    source: str


KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class Limit:
    bytes: int
    source: str


# The context-binary generator refuses a graph whose ESTIMATED allocation (weights + activations +
# spill-fill, not the file size) is over this; its message counts in KB of 1024 bytes.
_ALLOC_V69 = Limit(
    2_097_152 * KIB,
    "v68/v69 context-binary generator: 'graph requires estimated allocation of 5404364 KB, limit is "
    "2097152 KB' (avisre/gemma4-snapdragon-npu docs/CHALLENGES.md, Galaxy S22 target; "
    "pytorch/executorch#17782 on v68)",
)
_ALLOC_V73 = Limit(3_670_016 * KIB, "v73+ context-binary generator logs: limit 3670016 KB (docs/facts.md §2)")
# Each cDSP process domain is a 32-bit virtual address space until v81 (which maps above 4 GB).
_PD_32BIT = Limit(
    4 * GIB, "Hexagon OS: a cDSP process domain is a 32-bit address space up to v79 (docs/facts.md §2)"
)


@dataclass(frozen=True)
class PhoneClass:
    """Phones of one RAM size, and how much of it a bundle may keep pinned (DMA-mapped binaries, the
    LUTs and the KV cache) while Android, its services and the app keep running."""

    ram_gib: int
    reserve_gib: int  # what the rest of the phone needs; the bundle may pin ram - reserve
    derivation: str

    @property
    def ram_bytes(self) -> int:
        return self.ram_gib * GIB

    @property
    def pinnable_bytes(self) -> int:
        return (self.ram_gib - self.reserve_gib) * GIB

    @property
    def name(self) -> str:
        return f"{self.ram_gib} GB phone"


# An estimate, not a measurement: docs/facts.md §2 puts a bundle's share of an 8 GB phone at roughly 5 GB.
# That is an Android reserve of about 3 GiB (kernel, zram, system services, launcher and the app
# itself), which the same reserve carries to the larger phones. Only a phone can settle the real figure.
_RESERVE = (
    "RAM minus a 3 GiB Android reserve (kernel, zram, system services, the app); "
    "docs/facts.md §2 estimate ~5 GB on 8 GB"
)
PHONE_8GB = PhoneClass(8, 3, _RESERVE)
PHONE_12GB = PhoneClass(12, 3, _RESERVE)
PHONE_16GB = PhoneClass(16, 3, _RESERVE)


@dataclass(frozen=True)
class MemoryLimits:
    context_allocation: Limit  # per context binary, estimated allocation
    process_domain: Limit  # address space one DSP process domain can map
    phones: tuple[PhoneClass, ...]  # the phone classes this SoC ships in, smallest first

    def phone(self, ram_gib: int) -> PhoneClass:
        for p in self.phones:
            if p.ram_gib == ram_gib:
                return p
        raise KeyError(ram_gib)


@dataclass(frozen=True)
class Soc:
    name: str
    marketing_name: str
    soc_model: int
    dsp_arch: str
    vtcm_mib: int
    weight_sharing: bool
    matmul_16x16: bool
    lpbq_4bit_weights: bool
    aihub_device: str
    aihub_chipset: str
    memory: MemoryBandwidth
    example_devices: tuple[str, ...]
    limits: MemoryLimits
    notes: str = ""
    compute: HtpCompute | None = None  # None: no figure, the plan's rates are memory-bound only

    @property
    def htp_arch(self) -> int:
        """The number onnxruntime-qnn's `htp_arch` option and Genie's dsp_arch are built from."""
        return int(self.dsp_arch.removeprefix("v"))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["htp_arch"] = self.htp_arch
        return d


def _lpddr(kind: str, mtps: int, bus_bits: int, source: str) -> MemoryBandwidth:
    return MemoryBandwidth(
        gb_per_s=round(mtps * bus_bits / 8 / 1000, 1),
        dram=f"{kind}-{mtps}, {bus_bits}-bit bus",
        source=source,
    )


_V69_LIMITS = MemoryLimits(_ALLOC_V69, _PD_32BIT, (PHONE_8GB, PHONE_12GB))
_V73_LIMITS = MemoryLimits(_ALLOC_V73, _PD_32BIT, (PHONE_8GB, PHONE_12GB))
# 8 Elite phones start at 12 GB (Galaxy S25, Xiaomi 15, OnePlus 13).
_V79_LIMITS = MemoryLimits(_ALLOC_V73, _PD_32BIT, (PHONE_12GB, PHONE_16GB))

# Bandwidth is transfer rate x bus width (theoretical peak); the sources name the DRAM type and speed.
# v69 (8 Gen 1 / 8+ Gen 1): Qualcomm gives AI-Engine TOPS for the 888 (26 TOPS, CPU + GPU + HTP
# together) and, for 8 Gen 1, only ratios: "up to 4x" the 888's AI performance and a tensor accelerator
# "twice as fast". We take the 888's whole-engine 26 TOPS for 8 Gen 1's HTP alone at int8, and half of
# it for 16-bit activations (HMX rate for 16-bit activations is not published): both estimates.
_V69_COMPUTE = HtpCompute(
    int8_tops=26.0,
    a16_tops=13.0,
    source=(
        "estimate: Snapdragon 888 AI Engine 26 TOPS (Qualcomm, whole engine); 8 Gen 1 tensor "
        "accelerator 'twice as fast', AI 'up to 4x' (launch coverage 2021-11-30: hothardware, "
        "financialexpress); 16-bit activations taken at half the int8 rate (not published)"
    ),
)
_SRC_8G1 = "LPDDR5-6400 per launch coverage of 8 Gen 1 / 8+ Gen 1 (xda-developers; nanoreview 51.2 GB/s)"

SOCS: dict[str, Soc] = {
    soc.name: soc
    for soc in (
        Soc(
            name="SM8350",
            marketing_name="Snapdragon 888",
            soc_model=30,
            dsp_arch="v68",
            vtcm_mib=4,
            weight_sharing=False,
            matmul_16x16=False,
            lpbq_4bit_weights=False,
            aihub_device="Samsung Galaxy S21 (Family)",
            aihub_chipset="chipset:qualcomm-snapdragon-888",
            memory=_lpddr("LPDDR5", 6400, 64, "LPDDR5 per Qualcomm; 6400 MT/s unconfirmed"),
            example_devices=("Galaxy S21", "Xiaomi Mi 11", "OnePlus 9 Pro"),
            limits=_V69_LIMITS,
        ),
        Soc(
            name="SM8450",
            marketing_name="Snapdragon 8 Gen 1",
            soc_model=36,
            dsp_arch="v69",
            vtcm_mib=8,
            weight_sharing=False,
            matmul_16x16=False,
            lpbq_4bit_weights=True,
            aihub_device="Samsung Galaxy S22 (Family)",
            aihub_chipset="chipset:qualcomm-snapdragon-8gen1",
            memory=_lpddr("LPDDR5", 6400, 64, _SRC_8G1),
            example_devices=("Galaxy S22", "Xiaomi 12", "OnePlus 10 Pro"),
            limits=_V69_LIMITS,
            compute=_V69_COMPUTE,
        ),
        Soc(
            name="SM8475",
            marketing_name="Snapdragon 8+ Gen 1",
            soc_model=42,
            dsp_arch="v69",
            vtcm_mib=8,
            weight_sharing=False,
            matmul_16x16=False,
            lpbq_4bit_weights=True,
            aihub_device="",
            aihub_chipset="chipset:qualcomm-snapdragon-8plus-gen1",
            memory=_lpddr("LPDDR5", 6400, 64, _SRC_8G1),
            example_devices=("Galaxy Z Fold4", "Xiaomi 12T Pro", "OnePlus 10T"),
            limits=_V69_LIMITS,
            compute=_V69_COMPUTE,
            notes="no AI Hub device known for this chipset; the aihub compiler needs another SoC",
        ),
        Soc(
            name="SM8550",
            marketing_name="Snapdragon 8 Gen 2",
            soc_model=43,
            dsp_arch="v73",
            vtcm_mib=8,
            weight_sharing=True,
            matmul_16x16=True,
            lpbq_4bit_weights=True,
            aihub_device="Samsung Galaxy S23 (Family)",
            aihub_chipset="chipset:qualcomm-snapdragon-8gen2",
            memory=_lpddr("LPDDR5X", 8400, 64, "LPDDR5X-8400 per 8 Gen 2 launch coverage (wccftech)"),
            example_devices=("Galaxy S23", "Xiaomi 13", "OnePlus 11"),
            limits=_V73_LIMITS,
        ),
        Soc(
            name="SM8650",
            marketing_name="Snapdragon 8 Gen 3",
            soc_model=57,
            dsp_arch="v75",
            vtcm_mib=8,
            weight_sharing=True,
            matmul_16x16=True,
            lpbq_4bit_weights=True,
            aihub_device="Samsung Galaxy S24 (Family)",
            aihub_chipset="chipset:qualcomm-snapdragon-8gen3",
            memory=_lpddr("LPDDR5X", 9600, 64, "LPDDR5X-9600 per 8 Gen 3 launch coverage"),
            example_devices=("Galaxy S24", "Xiaomi 14", "OnePlus 12"),
            limits=_V73_LIMITS,
        ),
        Soc(
            name="SM8750",
            marketing_name="Snapdragon 8 Elite",
            soc_model=69,
            dsp_arch="v79",
            vtcm_mib=8,
            weight_sharing=True,
            matmul_16x16=True,
            lpbq_4bit_weights=True,
            aihub_device="Samsung Galaxy S25 (Family)",
            aihub_chipset="chipset:qualcomm-snapdragon-8-elite",
            memory=_lpddr("LPDDR5X", 10667, 64, "LPDDR5X-10667 per 8 Elite launch coverage"),
            example_devices=("Galaxy S25", "Xiaomi 15", "OnePlus 13"),
            limits=_V79_LIMITS,
        ),
    )
}


class UnknownSocError(ValueError):
    pass


def get_soc(name: str) -> Soc:
    try:
        return SOCS[name.upper()]
    except KeyError:
        raise UnknownSocError(f"unknown SoC {name!r}; allowed values: {', '.join(SOCS)}") from None
