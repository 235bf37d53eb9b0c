"""NVIDIA's Xid 144-150 decode table, both action columns."""

from agent.sources.nvlink5 import decode


def _value(pattern: str) -> int:
    return int(pattern.replace("-", "0"), 2)


def test_the_first_action_column_decides_when_its_intrinfo_matches():
    """RLW_RXPIPE with IntrInfo (R575+) 0b00000110 and status 0x1: NVIDIA's first column says IGNORE."""
    assert decode(145, _value("------000000------------00000110"), 0x1).bucket == "IGNORE"


def test_the_second_action_column_decides_when_its_intrinfo_matches():
    """The same subcode with the second decode's IntrInfo (0b10000110) is RESET_GPU in the table's second column."""
    decoded = decode(145, _value("------000000------------10000110"), 0x1)
    assert decoded is not None and decoded.bucket == "RESET_GPU"


def test_the_second_column_holds_for_drivers_before_r575_too():
    decoded = decode(145, _value("------000000---------10011000010"), 0x4)
    assert decoded is not None and decoded.bucket == "RESET_GPU"
