"""The CPU cgroup reader (:mod:`elastictrain.engine.cgroup`), the profile's arithmetic with it, and the quota
fault's pure choices (:mod:`chaos.faults`), from chosen text: no cgroup is touched."""

from __future__ import annotations

from pathlib import Path

import pytest

from chaos import faults
from elastictrain.engine import cgroup
from elastictrain.engine.profile import own_compute_seconds

HYBRID = """\
25 30 0:22 / /sys/fs/cgroup rw,relatime shared:9 - tmpfs tmpfs rw,mode=755
26 25 0:23 / /sys/fs/cgroup/unified rw,relatime shared:10 - cgroup2 cgroup2 rw
27 25 0:24 / /sys/fs/cgroup/cpu,cpuacct rw,relatime shared:11 - cgroup cgroup rw,cpu,cpuacct
28 25 0:25 / /sys/fs/cgroup/cpuset rw,relatime shared:12 - cgroup cgroup rw,cpuset
"""
PURE_V2 = "35 30 0:30 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"


def test_the_v1_cpu_controller_and_the_v2_hierarchy_are_found_and_cpuset_is_not_taken_for_cpu() -> None:
    assert cgroup.cpu_hierarchies(HYBRID) == cgroup.Hierarchies("/sys/fs/cgroup/cpu,cpuacct", "/sys/fs/cgroup/unified")
    assert cgroup.cpu_hierarchies(PURE_V2) == cgroup.Hierarchies(None, "/sys/fs/cgroup")
    assert cgroup.cpu_hierarchies("garbage\n\n1 2 3 - x\n") == cgroup.Hierarchies(None, None)


def test_a_threads_groups_and_every_ancestors_cpu_stat_are_read() -> None:
    proc = "4:cpuset:/\n3:cpu,cpuacct:/kube/pod1\n0::/user.slice/a\n"
    assert cgroup.cgroup_paths(proc) == ("/kube/pod1", "/user.slice/a")
    assert cgroup.stat_files(cgroup.cpu_hierarchies(HYBRID), proc) == [
        "/sys/fs/cgroup/cpu,cpuacct/kube/pod1/cpu.stat",
        "/sys/fs/cgroup/cpu,cpuacct/kube/cpu.stat",
        "/sys/fs/cgroup/cpu,cpuacct/cpu.stat",
        "/sys/fs/cgroup/unified/user.slice/a/cpu.stat",
        "/sys/fs/cgroup/unified/user.slice/cpu.stat",
        "/sys/fs/cgroup/unified/cpu.stat",
    ]
    assert cgroup.stat_files(cgroup.cpu_hierarchies(PURE_V2), "0::/../../etc\n") == [
        "/sys/fs/cgroup/etc/cpu.stat",
        "/sys/fs/cgroup/cpu.stat",
    ]


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("usage_usec 10\nnr_throttled 3\nthrottled_usec 2500000\n", 2.5),  # v2
        ("nr_periods 23\nnr_throttled 21\nthrottled_time 1697371152\n", 1.697371152),  # v1, ns
        (b"nr_throttled 1\nthrottled_time 5\n", 5e-9),
        ("usage_usec 10\nuser_usec 3\n", None),  # v2 without the cpu controller
        ("throttled_usec -4\n", None),
        ("throttled_usec lots\n", None),
        ("x" * 10_000 + "\nthrottled_usec 1\n", None),  # past the bound: not a cpu.stat
    ],
)
def test_throttled_time_is_read_from_either_version_and_bad_text_gives_none(text, seconds) -> None:
    assert cgroup.throttled_seconds(text) == seconds


def test_run_queue_delay_is_excused_only_beyond_the_time_the_threads_quota_throttled_it() -> None:
    # Busy neighbours: 0.2 s waiting for a core, no quota: the thread's own work is 0.3 s.
    assert own_compute_seconds(0.5, 0.2, 0.0) == pytest.approx(0.3)
    # 15% of a core: 1.7 s of a 2 s step waiting, all of it throttled: the host is that slow.
    assert own_compute_seconds(2.0, 1.7, 1.7) == pytest.approx(2.0)
    # A group's throttled time sums its CPUs' and may exceed the thread's delay: capped by the delay.
    assert own_compute_seconds(2.0, 1.0, 3.5) == pytest.approx(2.0)
    # Throttled part of the time, neighbours the rest.
    assert own_compute_seconds(1.0, 0.6, 0.4) == pytest.approx(0.8)
    assert own_compute_seconds(0.1, 0.5, -1.0) == 0.0  # never negative, a bad throttled figure counts as none


def test_the_throttle_clock_sums_the_groups_and_stays_monotonic_when_the_thread_moves(tmp_path: Path) -> None:
    root = tmp_path / "cpu"
    (root / "quota").mkdir(parents=True)
    (root / "cpu.stat").write_text("nr_throttled 0\nthrottled_time 0\n")
    (root / "quota" / "cpu.stat").write_text("nr_throttled 1\nthrottled_time 4000000000\n")
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"27 25 0:24 / {root} rw - cgroup cgroup rw,cpu\n")
    me = tmp_path / "cgroup"
    me.write_text("1:cpu:/quota\n")
    clock = cgroup.ThrottleClock(str(mountinfo), str(me))
    assert clock.seconds() == 0.0  # counts from the first reading
    (root / "quota" / "cpu.stat").write_text("nr_throttled 2\nthrottled_time 5500000000\n")
    assert clock.seconds() == pytest.approx(1.5)
    me.write_text("1:cpu:/\n")  # moved back out; the quota group's counter is no longer the thread's
    clock.refresh()
    assert clock.seconds() == pytest.approx(1.5)
    (root / "cpu.stat").write_text("nr_throttled 1\nthrottled_time 250000000\n")
    assert clock.seconds() == pytest.approx(1.75)
    clock.close()


def test_no_cgroups_reads_as_never_throttled(tmp_path: Path) -> None:
    clock = cgroup.ThrottleClock(str(tmp_path / "missing"), str(tmp_path / "missing-too"))
    assert clock.seconds() == clock.seconds() == 0.0


def test_the_quota_goes_to_cgroup_v2_when_it_offers_cpu_else_to_v1() -> None:
    both = cgroup.Hierarchies("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/unified")
    assert faults.choose_cpu_backend(both, "cpuset cpu io memory\n") == faults.CpuBackend(2, "/sys/fs/cgroup/unified")
    assert faults.choose_cpu_backend(both, "hugetlb\n") == faults.CpuBackend(1, "/sys/fs/cgroup/cpu")
    assert faults.choose_cpu_backend(both, None) == faults.CpuBackend(1, "/sys/fs/cgroup/cpu")
    with pytest.raises(faults.QuotaUnavailable, match="no CPU cgroup controller"):
        faults.choose_cpu_backend(cgroup.Hierarchies(None, "/sys/fs/cgroup"), "memory io\n")


def test_a_quota_is_a_share_of_one_core_per_100_ms_in_either_versions_files() -> None:
    assert faults.quota_files(2, 0.15) == {"cpu.max": "15000 100000"}
    assert faults.quota_files(2, None) == {"cpu.max": "max 100000"}
    assert faults.quota_files(1, 0.5) == {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "50000"}
    assert faults.quota_files(1, None)["cpu.cfs_quota_us"] == "-1"
    assert faults.quota_files(1, 2.0)["cpu.cfs_quota_us"] == "200000"  # two cores
    for bad in (0.0, 0.001, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="--cpu"):
            faults.quota_files(1, bad)
