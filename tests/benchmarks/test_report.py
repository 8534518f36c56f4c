"""The benchmark pages' markdown (ninfer_jax/benchmarks/report.py)."""

from ninfer_jax.benchmarks import report


def test_table_cells_keep_their_pipes_in_one_column():
    """A shape named "27b gdn in [qkv|z]" is one cell: its pipe is escaped, so every row has the header's columns."""
    lines = report.table(["shape", "us"], [["27b gdn in [qkv|z]", 33.2], ["o_proj", 29.3]])
    assert lines == ["| shape | us |", "|---|---|", "| 27b gdn in [qkv\\|z] | 33.2 |", "| o_proj | 29.3 |"]
    assert all(line.replace("\\|", "").count("|") == 3 for line in lines)
