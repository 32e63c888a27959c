"""The pure parts of the control-plane benchmark: etcd's Prometheus text, counter windows and their attribution
per host and minute, the death window from discover.sh polls, the statistics and the plan's rules. No etcd, no
processes."""

from __future__ import annotations

import pytest

from bench.control_plane import (
    QUICK,
    Plan,
    Window,
    counter_by,
    delta,
    gone_after,
    parse_prometheus,
    stats_ms,
    to_result,
)

ETCD_METRICS = """\
# HELP etcd_network_client_grpc_received_bytes_total The total number of bytes received from grpc clients.
# TYPE etcd_network_client_grpc_received_bytes_total counter
etcd_network_client_grpc_received_bytes_total 365
etcd_network_client_grpc_sent_bytes_total 989
etcd_debugging_mvcc_keys_total 1000
grpc_server_handled_total{grpc_code="OK",grpc_method="Range",grpc_service="etcdserverpb.KV",grpc_type="unary"} 4
grpc_server_handled_total{grpc_code="NotFound",grpc_method="Range",grpc_service="etcdserverpb.KV",grpc_type="unary"} 1
grpc_server_started_total{grpc_method="LeaseKeepAlive",grpc_service="etcdserverpb.Lease",grpc_type="bidi_stream"} 3
grpc_server_started_total{grpc_method="Range",grpc_service="etcdserverpb.KV",grpc_type="unary"} 5
grpc_server_started_total{grpc_method="Txn",grpc_service="etcdserverpb.KV",grpc_type="unary"} 1.5e+01
go_memstats_alloc_bytes 1.2345e+07
process_start_time_seconds{weird="a \\"quoted\\" label"} 1.7e+09 1733300000000
not a sample line
"""


def test_prometheus_text_is_parsed_into_named_labelled_samples() -> None:
    s = parse_prometheus(ETCD_METRICS)
    assert s[("etcd_network_client_grpc_sent_bytes_total", frozenset())] == 989
    assert s[("go_memstats_alloc_bytes", frozenset())] == 1.2345e7
    key = ("grpc_server_started_total", frozenset({
        ("grpc_method", "Txn"), ("grpc_service", "etcdserverpb.KV"), ("grpc_type", "unary"),
    }))  # fmt: skip
    assert s[key] == 15.0
    assert s[("process_start_time_seconds", frozenset({("weird", 'a \\"quoted\\" label')}))] == 1.7e9
    assert not any(name.startswith("#") or name == "not" for name, _ in s)


def test_counters_are_summed_by_label_and_filtered_by_labels() -> None:
    s = parse_prometheus(ETCD_METRICS)
    assert counter_by(s, "grpc_server_handled_total", "grpc_method") == {"Range": 5.0}
    assert counter_by(s, "grpc_server_handled_total", "grpc_code", {"grpc_method": "Range"}) == {
        "OK": 4.0,
        "NotFound": 1.0,
    }
    assert counter_by(s, "grpc_server_started_total", "grpc_method", {"grpc_type": "bidi_stream"}) == {
        "LeaseKeepAlive": 3.0
    }
    assert counter_by(s, "etcd_network_client_grpc_sent_bytes_total", "") == {"": 989.0}
    assert counter_by(s, "no_such_metric", "x") == {}


def test_delta_counts_new_keys_from_zero_and_drops_unchanged_ones() -> None:
    assert delta({"Range": 5, "Txn": 2}, {"Range": 65, "Txn": 2, "LeaseGrant": 3}) == {"Range": 60, "LeaseGrant": 3}


def _samples(range_calls: float, keepalives: float, received: float, sent: float) -> str:
    return (
        f'grpc_server_started_total{{grpc_method="Range",grpc_type="unary"}} {range_calls}\n'
        f'grpc_server_started_total{{grpc_method="LeaseKeepAlive",grpc_type="bidi_stream"}} {keepalives}\n'
        f"etcd_network_client_grpc_received_bytes_total {received}\n"
        f"etcd_network_client_grpc_sent_bytes_total {sent}\n"
    )


def test_a_window_gives_requests_per_second_by_method_and_bytes_per_host_per_minute() -> None:
    # 1000 hosts for 30 s: 10,000 keep-alives and 10,000 Ranges (one cycle per host every 3 s), 9 MB in all
    before = parse_prometheus(_samples(100, 100, 1_000, 2_000))
    after = parse_prometheus(_samples(10_100, 10_100, 1_001_000, 8_002_000))
    w = Window.between(before, after, seconds=30.0, hosts=1000.0)
    assert w.requests == {"Range": 10_000, "LeaseKeepAlive": 10_000}
    rates = w.per_second()
    assert rates["Range"] == pytest.approx(333.33, abs=0.01)
    assert rates["total"] == pytest.approx(666.67, abs=0.01)
    assert w.bytes_per_host_minute() == pytest.approx(9_000_000 / 1000 / 0.5)  # 18 kB per host per minute


def test_the_discovery_share_is_what_a_window_adds_over_the_same_load_without_it() -> None:
    agents = Window(seconds=30.0, hosts=1000.0, requests={"Range": 9_000, "LeaseKeepAlive": 9_000},
                    received_bytes=300_000, sent_bytes=3_000_000)  # fmt: skip
    both = Window(seconds=60.0, hosts=1000.0, requests={"Range": 18_040, "LeaseKeepAlive": 18_000},
                  received_bytes=600_000 + 6_000, sent_bytes=6_000_000 + 12_000_000)  # fmt: skip
    share = both.share(agents)
    assert share["requests_per_second"] == pytest.approx(40 / 60)
    assert share["bytes_per_second"] == pytest.approx(12_006_000 / 60)


def test_a_killed_host_is_gone_between_the_last_poll_that_listed_it_and_the_first_that_did_not() -> None:
    kill_at = 100.0
    polls = [
        (99.0, 99.2, True),  # before the kill: ignored
        (100.1, 100.3, True),
        (109.0, 109.2, True),
        (109.3, 109.45, False),
        (110.0, 110.2, False),
    ]
    low, high = gone_after(kill_at, polls)  # type: ignore[misc]
    assert low == pytest.approx(9.0)
    assert high == pytest.approx(9.45)
    assert gone_after(kill_at, [(100.5, 100.6, False)]) == (0.0, pytest.approx(0.6))
    assert gone_after(kill_at, [(101.0, 101.1, True)]) is None
    assert gone_after(kill_at, list(reversed(polls))) == gone_after(kill_at, polls)


def test_stats_use_the_nearest_rank_p99_so_one_slow_call_in_a_hundred_does_not_set_it() -> None:
    values = [100.0] * 99 + [900.0]
    s = stats_ms(values)
    assert (s["median"], s["p99"], s["max"], s["n"]) == (100.0, 100.0, 900.0, 100)
    assert stats_ms([*values, 800.0])["p99"] == 800.0
    assert stats_ms([])["p99"] is None


def test_the_plan_rejects_impossible_counts_and_the_quick_plan_keeps_1000_hosts() -> None:
    with pytest.raises(ValueError, match="real_agents"):
        Plan(hosts=5, real_agents=5)
    with pytest.raises(ValueError, match="kills"):
        Plan(real_agents=2, kills=3)
    with pytest.raises(ValueError, match="window"):
        Plan(window_seconds=1)
    assert QUICK.hosts == 1000 and QUICK.simulated == 1000 - QUICK.real_agents
    assert Plan(ttl_seconds=10).death_goal.target == 12.0


def test_a_measurement_becomes_metrics_with_the_two_goals() -> None:
    win = {"seconds": 30.0, "hosts": 1000.0, "bytes_per_host_minute": 16_000.0, "received_bytes": 1.0,
           "sent_bytes": 1.0, "cpu_cores": {}, "requests_per_second": {"Range": 333.0, "LeaseKeepAlive": 333.0,
                                                                      "total": 666.0}}  # fmt: skip
    measured = {
        "plan": {"hosts": 1000, "real_agents": 5, "kills": 2},
        "discover_ms": {"n": 120, "median": 120.0, "p99": 180.0, "min": 90.0, "max": 200.0},
        "deaths": [{"seconds": 9.5}, {"seconds": 12.5}],
        "etcd": {
            "agents": win,
            "agents_and_discovery": win,
            "discovery_share": {"requests_per_second": 0.5, "bytes_per_host_minute": 1_000.0},
        },
        "driver": {
            "hosts": 1000,
            "update_host_assignments_cold_ms": 5.0,
            "update_host_assignments_churn_ms": {"median": 4.0},
            "parse_ms": {"median": 0.3},
            "find_available_hosts_and_slots_ms": {"median": 130.0},
        },
    }
    result = to_result(measured)
    by_name = {m.name: m for m in result.metrics}
    p99 = by_name["discover.sh p99, 1000 hosts"]
    assert p99.value == 180.0 and p99.goal is not None and p99.goal.met(p99.value) is False
    death = by_name["agent SIGKILL -> gone from discover.sh, max"]
    assert death.value == 12.5 and death.goal is not None and death.goal.target == 12.0
    assert death.goal.met(death.value) is False
    assert by_name["etcd requests/s, agents + churn"].value == 666.0
