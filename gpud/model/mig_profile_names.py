"""MIG device profile names as users write them: `3g.20gb`, `1c.3g.20gb`, `1g.5gb+me`.

`<G>g` is the GPU instance's compute slices, `<GB>gb` its memory rounded the way NVIDIA's tools
round it, and an optional `<C>c.` prefix names a compute instance smaller than its GPU instance.
A trailing attribute says which media engines the GPU instance has.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# "+me": media extensions; "+me.all": all media engines; "+gfx": graphics; "-me": no media engine.
SUFFIXES = ("", "+me", "+me.all", "+gfx", "-me")

_EXPECTED_FORMS = "expected <G>g.<GB>gb or <C>c.<G>g.<GB>gb (C < G), optionally followed by +me, +me.all, +gfx or -me"

# Numbers without leading zeros, so that every accepted name formats back to itself (bar "<G>c.<G>g").
_NUMBER = r"(?:0|[1-9][0-9]*)"
_PATTERN = re.compile(rf"(?:(?P<ci>{_NUMBER})c\.)?(?P<gi>{_NUMBER})g\.(?P<gb>{_NUMBER})gb(?P<suffix>[+-][a-z.]+)?")


def mig_device_name(gi_profile_name: str, gi_slices: int, ci_slices: int) -> str:
    """A MIG device's profile name: its GPU instance's profile name, prefixed by <C>c. when the
    compute instance is smaller than the GPU instance (MIG user guide, "MIG Device Names")."""
    return gi_profile_name if ci_slices >= gi_slices else f"{ci_slices}c.{gi_profile_name}"


def _well_formed(text: str) -> re.Match:
    match = _PATTERN.fullmatch(text)
    if match is None:
        raise ValueError(_EXPECTED_FORMS)
    return match


def read_layout_profile(text: str) -> tuple[str, str | None]:
    """A profile name as a layout file writes it: (the name to key it by, why no GPU can offer it,
    or None when some GPU may). Raises ValueError only for a malformed name.

    mig-parted checks the name's form only (pkg/types/mig_profile.go AssertValidMigProfileFormat,
    called by MigConfig.AssertValidFormat while api/spec/v1 MigConfigSpec.UnmarshalJSON reads
    `mig-devices`; go-nvlib pkg/nvlib/device/mig_profile.go parseMigProfileFields only reads the
    numbers). So `0g.5gb` or `2c.1g.5gb` load there and only applying the layout fails; a file is
    not refused for them. The impossible name is kept as written: formatting it would turn
    `2c.1g.5gb` into the possible `1g.5gb`.
    """
    match = _PATTERN.fullmatch(text)
    if match is None or (match["suffix"] or "") not in SUFFIXES:
        return str(MigProfileName.parse(text)), None  # raises parse's ValueError, naming the text
    try:
        return str(MigProfileName._from_match(match)), None
    except ValueError as error:  # a zero, or a compute instance larger than its GPU instance
        return text, str(error)


@dataclass(frozen=True)
class MigProfileName:
    ci_slices: int  # compute slices of the compute instance; equals gi_slices when it takes the whole GPU instance
    gi_slices: int
    memory_gb: int
    suffix: str = ""  # one of SUFFIXES

    def __post_init__(self) -> None:
        if min(self.ci_slices, self.gi_slices, self.memory_gb) < 1:
            raise ValueError("slice counts and memory size must be at least 1")
        if self.ci_slices > self.gi_slices:
            raise ValueError(f"a compute instance ({self.ci_slices}c) cannot be larger than "
                             f"its GPU instance ({self.gi_slices}g)")
        if self.suffix not in SUFFIXES:
            raise ValueError(f"unknown attribute {self.suffix!r} (known: {', '.join(SUFFIXES[1:])})")

    @classmethod
    def parse(cls, text: str) -> MigProfileName:
        try:
            return cls._from_match(_well_formed(text))
        except ValueError as error:
            raise ValueError(f"invalid MIG profile name {text!r}: {error}") from None

    @classmethod
    def _from_match(cls, match: re.Match) -> MigProfileName:
        gi_slices = int(match["gi"])
        return cls(ci_slices=int(match["ci"] or gi_slices), gi_slices=gi_slices,
                   memory_gb=int(match["gb"]), suffix=match["suffix"] or "")

    @property
    def gi_name(self) -> str:
        """The GPU-instance profile this device lives in, e.g. "3g.20gb+me"."""
        return f"{self.gi_slices}g.{self.memory_gb}gb{self.suffix}"

    def __str__(self) -> str:
        return mig_device_name(self.gi_name, self.gi_slices, self.ci_slices)
