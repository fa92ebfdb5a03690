"""fedbayes.cli.common: what the commands share."""

import pytest

from fedbayes.cli.common import DETERMINISTIC_GPU_FLAG, gpu_repeatability_note


@pytest.mark.parametrize(
    ("backend", "flags", "noted"),
    [
        ("cpu", "", False),
        ("cpu", "--xla_force_host_platform_device_count=2", False),
        ("gpu", "", True),
        ("gpu", "--xla_gpu_autotune_level=0", True),
        ("gpu", DETERMINISTIC_GPU_FLAG, False),
        ("gpu", "--xla_gpu_deterministic_ops", False),
        ("gpu", "--xla_gpu_deterministic_ops=1 --xla_gpu_autotune_level=0", False),
        ("gpu", "--xla_gpu_deterministic_ops=false", True),
        ("gpu", f"{DETERMINISTIC_GPU_FLAG} --xla_gpu_deterministic_ops=false", True),
        ("gpu", "--xla_gpu_deterministic_ops=true_not", True),
    ],
)
def test_gpu_repeatability_note(backend, flags, noted):
    line = gpu_repeatability_note(backend, flags)
    assert (line is not None) == noted
    if noted:
        assert line.startswith("note: ") and "\n" not in line and DETERMINISTIC_GPU_FLAG in line
