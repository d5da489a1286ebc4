"""What Genie accepts in genie_config.json and how it applies it, on the host without a bundle: the
sampler's ranges and greedy rule, the query text `make run` and verify share, Genie's validator when
its library is missing, and the compile stage's SoC string check."""

from __future__ import annotations

import json
import sys

import pytest

from stages.runtimes.genie.rules import sampler_is_greedy, sampler_problems

GEMMA = {"version": 1, "seed": 42, "temp": 1.0, "top-k": 64, "top-p": 0.95}


@pytest.mark.parametrize(
    "sampler,greedy",
    [
        (GEMMA, False),
        ({**GEMMA, "top-k": 1}, True),
        ({**GEMMA, "temp": 0.0}, True),
        ({**GEMMA, "top-k": 0}, False),  # 0: the whole vocabulary
        ({"version": 1}, False),  # Genie's defaults: temp 0.1, top-k 0
    ],
)
def test_genie_samples_greedily_only_at_temp_0_or_top_k_1(sampler, greedy):
    assert sampler_is_greedy(sampler) is greedy


@pytest.mark.parametrize(
    "field,value,line",
    [
        ("temp", -0.5, "sampler.temp is -0.5; Genie's schema needs temp >= 0 (0: greedy)"),
        ("top-k", -1, "sampler.top-k is -1; Genie takes 0 (all) to n-vocab 262 (1: greedy)"),
        ("top-k", 263, "sampler.top-k is 263; Genie takes 0 (all) to n-vocab 262 (1: greedy)"),
        ("top-k", 2.5, "sampler.top-k is 2.5, not an integer"),
        ("top-p", 1.5, "sampler.top-p is 1.5; Genie's schema needs 0 <= top-p <= 1"),
        ("seed", -2, "sampler.seed is -2; Genie takes -1 (clock) or a seed >= 0"),
        ("temp", "hot", "sampler.temp is 'hot', not a number"),
    ],
)
def test_a_sampler_genie_refuses_is_named_by_field(field, value, line):
    assert sampler_problems(GEMMA, 262) == []
    assert sampler_problems({**GEMMA, field: value}, 262) == [line]


def _bundle(tmp_path, bos_token: int):
    (tmp_path / "genie_config.json").write_text(json.dumps({"dialog": {"context": {"bos-token": bos_token}}}))
    template = "{{ bos_token }}<|turn>user\n{{ messages[0]['content'] }}<turn|>\n<|turn>model\n"
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<bos>", "chat_template": template})
    )
    return tmp_path


def test_the_query_text_leaves_the_bos_to_genie_when_it_adds_one(tmp_path):
    from stages.runtimes.genie.prompt import query_text

    assert query_text(_bundle(tmp_path, 2), "hi") == "<|turn>user\nhi<turn|>\n<|turn>model"
    # bos-token -1: Genie adds none (qualla Dialog::query), so the template's stays.
    assert query_text(_bundle(tmp_path, -1), "hi").startswith("<bos><|turn>user")


def test_genie_s_validator_missing_is_a_problem_not_a_pass(monkeypatch):
    from stages.runtimes.genie.bundle import genie_validator_errors

    monkeypatch.setitem(sys.modules, "onnxruntime_qnn", None)  # import fails as if not installed
    (line,) = genie_validator_errors({"dialog": {}})
    assert line.startswith("Genie's validator could not run (ModuleNotFoundError")
    assert "onnxruntime-qnn" in line and "RUNNER=docker" in line


def test_a_binary_without_the_soc_string_is_refused(tmp_path):
    from stages.compile import CompileError, check_binary
    from stages.core.soc import get_soc

    soc = get_soc("SM8450")
    good = tmp_path / "good.bin"
    good.write_bytes(b"QNN soc_type=SM8450;arch=69; inputs_embeds")
    assert check_binary(good, soc, ["inputs_embeds"]) == {"soc_type": "SM8450", "arch": 69}
    bare = tmp_path / "bare.bin"
    bare.write_bytes(b"QNN inputs_embeds")
    with pytest.raises(CompileError, match="bare.bin carries no soc_type=...;arch=... string"):
        check_binary(bare, soc, ["inputs_embeds"])
