"""`artifacts gc --max-size`: the sizes it reads (pydantic's ByteSize, binary units as always)."""

from __future__ import annotations

from pathlib import Path

import pytest

from neuronctl.errors import UsageError
from neuronctl.store.gc import parse_size
from tests.helpers import cli

GIB = 1024**3


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("4096", 4096),
        ("0", 0),
        ("500b", 500),
        ("10GB", 10 * GIB),
        ("10G", 10 * GIB),
        ("10 gib", 10 * GIB),
        ("500MiB", 500 * 1024**2),
        ("1.5T", int(1.5 * 1024**4)),
        (" 50G ", 50 * GIB),
    ],
)
def test_sizes_read_as_binary_units(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "lots", "-5G", "10GB of disk", "5x", "1e9", "G"])
def test_what_is_not_a_size_is_a_usage_error(text: str) -> None:
    with pytest.raises(UsageError, match="is not a size") as info:
        parse_size(text)
    assert "1G = 1024**3 bytes" in (info.value.hint or "")


def test_cli_bad_size_exits_2_with_one_line(tmp_path: Path) -> None:
    result = cli("artifacts", "gc", "--max-size", "lots", "--store", str(tmp_path))
    assert result.returncode == 2
    assert "--max-size: 'lots' is not a size" in result.stderr
    assert "Traceback" not in result.stderr
