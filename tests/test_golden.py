"""A change of structure leaves what memo prints byte-identical: the golden set of `tests/golden.py`."""

import golden
import pytest


@pytest.mark.parametrize("name", list(golden.golden()))
def test_output_is_byte_identical_to_the_golden_set(name):
    expected = (golden.HERE / f"{name}.txt").read_text()
    assert golden.golden()[name]() == expected
