"""gpud's one reader of Kubernetes quantities (gpud/base/quantity.py), as k8s.io/apimachinery
pkg/api/resource/quantity.go reads them."""

from __future__ import annotations

from fractions import Fraction

import pytest

from gpud.base.quantity import parse_quantity, whole_quantity


@pytest.mark.parametrize("text, value", [
    ("0", 0), ("512Mi", 512 << 20), ("10Gi", 10 << 30), ("1.5Gi", 3 << 29), ("1500Ki", 1500 << 10), ("1k", 1000),
    ("2M", 2 * 10 ** 6), ("5e3", 5000), ("1E-3", Fraction(1, 1000)), ("100m", Fraction(1, 10)), ("-1Gi", -(1 << 30)),
    (".5", Fraction(1, 2)), ("+7", 7)])
def test_quantities_read_exactly(text, value):
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "Gi", "10 Gi", " 10Gi", "10gi", "10GiB", "1..5", "0x10", "1" * 65, None, 10, [1]])
def test_what_is_no_quantity_is_refused(text):
    with pytest.raises(ValueError):
        parse_quantity(text)


def test_an_exponent_past_100_is_refused_unread():
    """apimachinery reads "1e99999999" (any int32 exponent); read exactly, that number took seconds."""
    assert parse_quantity("1e100") == 10 ** 100 and parse_quantity("1e-100") == Fraction(1, 10 ** 100)
    for text in ("1e101", "1e-101", "1e99999999", "9E-2147483648"):
        with pytest.raises(ValueError, match="exponent past"):
            parse_quantity(text)


def test_whole_quantities_are_whole_numbers_at_least_zero():
    assert [whole_quantity(v) for v in ("80Gi", "132", 7, "2e3")] == [80 << 30, 132, 7, 2000]
    for value in ("1.5", "100m", "-1", -1, True, 1.0, None):
        with pytest.raises(ValueError):
            whole_quantity(value)
