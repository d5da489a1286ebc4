import pytest

from stages.core.soc import SOCS, UnknownSocError, get_soc


def test_table_has_the_six_targets():
    assert list(SOCS) == ["SM8350", "SM8450", "SM8475", "SM8550", "SM8650", "SM8750"]


def test_sm8450_is_v69_without_weight_sharing_or_16x16_matmul():
    soc = get_soc("sm8450")
    assert (soc.soc_model, soc.dsp_arch, soc.htp_arch, soc.vtcm_mib) == (36, "v69", 69, 8)
    assert not soc.weight_sharing and not soc.matmul_16x16
    assert soc.aihub_device == "Samsung Galaxy S22 (Family)"
    assert soc.aihub_chipset == "chipset:qualcomm-snapdragon-8gen1"
    assert soc.memory.gb_per_s == 51.2


@pytest.mark.parametrize("name", list(SOCS))
def test_capabilities_follow_the_architecture(name):
    soc = SOCS[name]
    newer = soc.htp_arch >= 73
    assert soc.weight_sharing == newer
    assert soc.matmul_16x16 == newer
    assert soc.lpbq_4bit_weights == (soc.htp_arch >= 69)
    assert soc.memory.gb_per_s > 40 and soc.memory.source
    assert soc.soc_model > 0 and soc.to_dict()["htp_arch"] == soc.htp_arch


def test_soc_models_are_unique():
    assert len({s.soc_model for s in SOCS.values()}) == len(SOCS)


def test_unknown_soc_names_the_allowed_values():
    with pytest.raises(UnknownSocError, match="SM8450"):
        get_soc("SM1234")


def test_v68_v69_context_limit_is_2_gib_and_v73_up_3_5_gib():
    for soc in SOCS.values():
        limit = soc.limits.context_allocation
        # The compiler's own message counts KB of 1024 bytes.
        assert limit.bytes == (2_097_152 if soc.htp_arch <= 69 else 3_670_016) * 1024
        assert "KB" in limit.source or "limit" in limit.source


@pytest.mark.parametrize("name", list(SOCS))
def test_every_memory_limit_carries_its_source(name):
    limits = SOCS[name].limits
    assert limits.process_domain.bytes == 4 << 30  # 32-bit process domains up to v79
    assert limits.context_allocation.source and limits.process_domain.source
    assert limits.phones and [p.ram_gib for p in limits.phones] == sorted(p.ram_gib for p in limits.phones)
    for phone in limits.phones:
        assert 0 < phone.pinnable_bytes < phone.ram_bytes and "reserve" in phone.derivation


def test_an_8gb_galaxy_s22_may_pin_about_5_gb():
    phone = get_soc("SM8450").limits.phone(8)
    assert phone.pinnable_bytes == 5 << 30  # docs/facts.md §2: roughly 5 GB of an 8 GB phone
    assert "docs/facts.md" in phone.derivation
