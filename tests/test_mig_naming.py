"""MIG profile names derived from sizes, checked against the names NVIDIA publishes (reference tables)."""

import pytest

from gpud.model.mig_profile_names import mig_device_name
from gpud.nvml.mig import gi_profile_name, mig_memory_gb

# (device MiB, GI slices, GI memory MiB, published name) from shared/reference/mig-profiles.md §2-§3.
PUBLISHED = [
    (40537, 1, 4864, "1g.5gb"), (40537, 1, 9856, "1g.10gb"), (40537, 2, 9856, "2g.10gb"),
    (40537, 3, 19968, "3g.20gb"), (40537, 4, 19968, "4g.20gb"), (40537, 7, 40192, "7g.40gb"),
    (40537, 1, 9984, "1g.10gb"),  # the same profile at a newer driver's size keeps its name
    (81920, 1, 9728, "1g.10gb"), (81920, 1, 19968, "1g.20gb"), (81920, 3, 40192, "3g.40gb"),
    (81920, 7, 80640, "7g.80gb"),
    (81559, 1, 9984, "1g.10gb"), (81559, 1, 20096, "1g.20gb"), (81559, 2, 20096, "2g.20gb"),
    (81559, 3, 40448, "3g.40gb"), (81559, 4, 40448, "4g.40gb"), (81559, 7, 81152, "7g.80gb"),
    (143771, 1, 16384, "1g.18gb"), (143771, 1, 33024, "1g.35gb"), (143771, 3, 71168, "3g.71gb"),
    (143771, 7, 143360, "7g.141gb"),
    (24576, 1, 5952, "1g.6gb"), (24576, 2, 11968, "2g.12gb"), (24576, 4, 24064, "4g.24gb"),
    (95830, 1, 11008, "1g.12gb"), (95830, 3, 47488, "3g.47gb"), (95830, 7, 95360, "7g.94gb"),
]


@pytest.mark.parametrize("device_mib, slices, instance_mib, name", PUBLISHED)
def test_whole_instance_names_match_nvidia(device_mib, slices, instance_mib, name):
    assert gi_profile_name(slices, instance_mib, device_mib) == name


def test_compute_instance_smaller_than_its_gpu_instance_is_prefixed():
    assert mig_device_name(gi_profile_name(3, 19968, 40537), 3, 1) == "1c.3g.20gb"
    assert mig_device_name(gi_profile_name(7, 40192, 40537), 7, 4) == "4c.7g.40gb"


def test_media_extension_suffix():
    assert gi_profile_name(1, 4864, 40537, "+me") == "1g.5gb+me"


def test_share_is_rounded_up_to_an_eighth():
    # a hair over one eighth is two eighths
    assert mig_memory_gb(40537 // 8 + 1, 40537) == 10
    assert mig_memory_gb(40537 // 8, 40537) == 5
