"""Graph names that sort in part order: Genie runs the graphs of one AR in name order (a std::set)."""

from __future__ import annotations

import pytest

from stages.compile import CompileError, rename_graph, sortable_graph_name

HASHED = "QNNExecutionProvider_QNNExecutionProvider_5879364967291772474_1_0"


def test_names_keep_their_length_and_sort_in_part_order_past_nine_parts():
    hashes = ["9" * 19, "14671144965915140770", "5" * 19, "1" * 20]  # hash order is not part order
    names = [
        sortable_graph_name(f"QNNExecutionProvider_QNNExecutionProvider_{h}_1_0", part, 12)
        for part, h in zip((1, 2, 10, 11), hashes, strict=True)
    ]
    assert sorted(names) == names
    for n, p in zip(names, (1, 2, 10, 11), strict=True):
        assert n.startswith(f"part{p:03d}_of_012_") and n.endswith(f"_{p}_of_12")  # Genie's split naming
    assert len(sortable_graph_name(HASHED, 1, 2)) == len(HASHED)


def test_rename_rewrites_every_occurrence_in_a_new_file(tmp_path):
    path = tmp_path / "a.bin"
    path.write_bytes(b"\x00" + HASHED.encode() + b"\x01" + HASHED.encode())
    link = tmp_path / "link.bin"
    link.hardlink_to(path)
    new = rename_graph(path, HASHED, 2, 2)
    assert path.read_bytes() == b"\x00" + new.encode() + b"\x01" + new.encode()
    assert link.read_bytes().count(HASHED.encode()) == 2  # a hard link elsewhere keeps its bytes
    with pytest.raises(CompileError, match="not in the binary"):
        rename_graph(path, HASHED, 2, 2)
