"""The CPU layout the CLI and the benchmarks set before JAX starts (no JAX needed here)."""

from fedbayes.sim import hostdevices as hd


def test_one_device_per_core_with_default_threading():
    flags = hd.xla_flags("--foo --xla_cpu_multi_thread_eigen=false --xla_force_host_platform_device_count=9", device_count=4)
    assert flags.split() == ["--foo", f"{hd.DEVICE_COUNT_FLAG}=4"]


def test_single_threaded_flags_for_pinned_processes():
    flags = hd.xla_flags("--foo --xla_force_host_platform_device_count=8 --xla_cpu_multi_thread_eigen=true", device_count=1, single_thread=True)
    assert flags.split() == ["--foo", f"{hd.DEVICE_COUNT_FLAG}=1", *hd.SINGLE_THREAD_FLAGS]


def test_configure_sets_flags_once_and_keeps_a_users_flags():
    env = {"XLA_FLAGS": "--bar --xla_cpu_multi_thread_eigen=false"}
    assert hd.configure(env)
    assert env["XLA_FLAGS"].split() == ["--bar", "--xla_cpu_multi_thread_eigen=false", f"{hd.DEVICE_COUNT_FLAG}={hd.num_cores()}"]
    assert not hd.configure(env)  # already laid out: unchanged
    mine = {"XLA_FLAGS": f"{hd.DEVICE_COUNT_FLAG}=3"}
    assert not hd.configure(mine) and mine["XLA_FLAGS"] == f"{hd.DEVICE_COUNT_FLAG}=3"
    empty: dict[str, str] = {}
    assert hd.configure(empty) and hd.DEVICE_COUNT_FLAG in empty["XLA_FLAGS"]
