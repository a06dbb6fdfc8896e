"""Kubernetes quantities ("512Mi", "10Gi", "1.5G", "100", "5e3"), read exactly, as k8s.io/apimachinery
pkg/api/resource/quantity.go ParseQuantity reads them: an optional sign, a decimal number, then a binary
suffix (Ki..Ei), a decimal suffix (m, k..E) or a decimal exponent. One reader for every quantity gpud takes
from a config, a claim or an allocation."""

from __future__ import annotations

import re
from fractions import Fraction

# quantity.go: the longest quantity it parses is far below this; a longer text is refused unread
MAX_QUANTITY_LENGTH = 64
# apimachinery takes any int32 exponent (suffix.go interpret), and "1e99999999" fits in 64 characters: read
# exactly, that is a number of 100 million digits, seconds of work. An exponent past this one is refused
# unread: 2^63-1, the most apimachinery keeps of a binary quantity (quantity.go maxAllowed), is below 10^19,
# and every quantity gpud reads (memory, counts) is far below that.
MAX_EXPONENT = 100
_QUANTITY = re.compile(r"([+-]?)(\d+(?:\.\d*)?|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E|[eE][+-]?\d+)?")
_FACTORS = {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60,
            "m": Fraction(1, 1000), "k": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9, "T": 10 ** 12, "P": 10 ** 15,
            "E": 10 ** 18}


def parse_quantity(text: str) -> Fraction:
    """The quantity's exact value; ValueError for a text that is none."""
    match = _QUANTITY.fullmatch(text) if isinstance(text, str) and len(text) <= MAX_QUANTITY_LENGTH else None
    if not match:
        raise ValueError(f"not a Kubernetes quantity such as 512Mi or 10Gi: {str(text)[:80]!r}")
    sign, number, suffix = match.groups()
    exponent = int(suffix[1:]) if suffix and suffix[0] in "eE" else None
    if exponent is not None and abs(exponent) > MAX_EXPONENT:
        raise ValueError(f"the quantity {text!r} has an exponent past +-{MAX_EXPONENT}: gpud reads none so large")
    factor = _FACTORS[suffix] if exponent is None else Fraction(10) ** exponent
    value = Fraction(number) * factor
    return -value if sign == "-" else value


def whole_quantity(value: object) -> int:
    """A quantity that is a whole number at least 0 ("1Mi", "4Gi", "512", or an int), as an int; ValueError
    for anything else (a fraction, a negative value)."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = Fraction(value)
    elif isinstance(value, str):
        number = parse_quantity(value)
    else:
        raise ValueError(f"{value!r} is not a quantity")
    if number < 0 or number.denominator != 1:
        raise ValueError(f"{value!r} is not a whole quantity")
    return int(number)
