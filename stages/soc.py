"""The SoC table: the one place that states what each Snapdragon target can do.

soc_model, dsp_arch and VTCM as in ExecuTorch's QNN backend (qc_schema.py _soc_info_table); AI Hub
device names and chipset attributes as in qai-hub-models' device registry; weight sharing from
v73 (qai-hub-models refuses it below hexagon 73). 16x16 activation matmul on v69 is documented as
unsupported in FACTS.md but not confirmed by a Qualcomm document.

Templates, the config validator, the planner and the compile rules check read these rows; nothing
else may hard-code a soc_model, an HTP architecture or a capability.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class MemoryBandwidth:
    gb_per_s: float
    dram: str
    source: str


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
    notes: str = ""

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


# Bandwidth is transfer rate x bus width (theoretical peak); the sources name the DRAM type and speed.
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
