"""The launcher's live view: the status from crafted events and a fake clock, the incremental tail, the output."""

from __future__ import annotations

import io
import json
from pathlib import Path

from elastictrain.rundir import layout
from elastictrain.rundir.events import Done, EpochEnd, Event, Metrics, Reset, Start, encode
from elastictrain.tools.live_view import STATUS_KIND, EventTail, LiveView, fold, status_line, view

T0 = 1_000_000.0


def at(t: float, event: type[Event], step: int, world_size: int = 2, epoch: int = 0, **fields: object) -> Event:
    return event(ts=T0 + t, step=step, epoch=epoch, world_size=world_size, **fields)  # type: ignore[arg-type]


RUN = [
    at(0, Start, 0, hosts=["a", "b"]),
    at(10, Metrics, 10, loss=2.0, samples_per_sec=64.0, steps=10, step_seconds=0.9),
    at(20, Metrics, 20, loss=1.5, samples_per_sec=66.0, steps=10, step_seconds=0.9),
    at(25, EpochEnd, 25, epoch_seconds=25.0),
]


def test_the_status_has_size_step_throughput_loss_and_an_eta_from_the_measured_rate() -> None:
    v = view(fold(RUN), T0 + 26, epochs=4)
    assert (v["state"], v["step"], v["epoch"], v["world_size"]) == ("running", 25, 0, 2)
    assert (v["samples_per_sec"], v["loss"], v["total_steps"]) == (66.0, 1.5, 100)  # 4 epochs of 25 steps
    assert v["eta_seconds"] == 75.0  # 75 steps left at 1 step/s (10 steps in 10 s between the metrics)
    assert v["last_reset"] is None and v["kind"] == STATUS_KIND
    line = status_line(v)
    assert "step 25/100" in line and "2 workers" in line and "66.0 samples/s" in line and "loss 1.5000" in line
    assert "ETA 1m15s" in line and "no reset" in line


def test_max_steps_bounds_the_length_before_an_epoch_has_ended() -> None:
    v = view(fold(RUN[:3]), T0 + 21, epochs=4, max_steps=50)
    assert (v["total_steps"], v["eta_seconds"]) == (50, 30.0)
    assert view(fold(RUN[:3]), T0 + 21, epochs=4)["eta_seconds"] is None, "no epoch seen, no max_steps: unknown"


def test_the_last_reset_shows_its_sizes_reason_recovery_and_age_and_the_rate_is_measured_afresh() -> None:
    reset = at(30, Reset, 20, world_size=1, old_size=2, new_size=1, reason="worker_failed", recovery_seconds=4.2)
    after = at(40, Metrics, 24, world_size=1, loss=1.4, samples_per_sec=30.0, steps=4, step_seconds=2.5)
    v = view(fold([*RUN, reset, after]), T0 + 72, epochs=4)
    assert v["last_reset"] == {
        "ts": T0 + 30,
        "age_seconds": 42.0,
        "old_size": 2,
        "new_size": 1,
        "reason": "worker_failed",
        "recovery_seconds": 4.2,
    }
    assert v["world_size"] == 1 and v["eta_seconds"] == (100 - 24) * 2.5  # one interval since the reset
    assert "last reset 2->1 (worker_failed) 42s ago, recovered in 4.2s" in status_line(v)


def test_a_finished_run_says_done_with_no_time_left() -> None:
    v = view(fold([*RUN, at(90, Done, 100, final_loss=0.1)]), T0 + 95, epochs=4)
    assert (v["state"], v["eta_seconds"]) == ("done", 0.0)
    assert status_line(v).startswith("done: step 100")


def test_before_any_event_the_line_says_it_waits() -> None:
    v = view(fold([]), T0)
    assert v["state"] == "not_started" and "waiting" in status_line(v)


def append(path: Path, data: bytes) -> None:
    with path.open("ab") as f:
        f.write(data)


def test_the_tail_picks_up_a_file_that_appears_late_and_reads_only_new_complete_lines(tmp_path: Path) -> None:
    path = tmp_path / layout.EVENTS
    tail = EventTail(path)
    assert tail.poll() == []
    first, second = encode(RUN[0]), encode(RUN[1])
    append(path, first + second[:15])  # the second line is half written
    assert tail.poll() == [RUN[0]]
    assert tail.poll() == []
    append(path, second[15:] + b"not json\n")
    assert tail.poll() == [RUN[1]] and tail.skipped == 1


def test_the_tail_starts_over_when_the_file_is_truncated_or_replaced(tmp_path: Path) -> None:
    path = tmp_path / layout.EVENTS
    tail = EventTail(path)
    path.write_bytes(encode(RUN[0]) + encode(RUN[1]))
    assert len(tail.poll()) == 2
    path.write_bytes(encode(RUN[2]))  # truncated and rewritten, shorter than before
    assert tail.poll() == [RUN[2]]
    replacement = tmp_path / "new"
    replacement.write_bytes(encode(RUN[0]) + encode(RUN[1]) + encode(RUN[3]))
    replacement.replace(path)
    assert tail.poll() == [RUN[0], RUN[1], RUN[3]]


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_off_a_terminal_a_json_line_comes_every_n_seconds(tmp_path: Path) -> None:
    path, out, clock = tmp_path / layout.EVENTS, io.StringIO(), Clock(T0)
    live = LiveView(path, out, every_seconds=30, tty=False, epochs=4, clock=clock)
    path.write_bytes(b"".join(encode(e) for e in RUN))
    live.tick()
    assert out.getvalue() == "", "the first line comes after N seconds"
    clock.now = T0 + 30
    live.tick()
    clock.now = T0 + 45
    live.tick()
    clock.now = T0 + 60
    live.tick()
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(v["ts"], v["step"], v["total_steps"]) for v in lines] == [(T0 + 30, 25, 100), (T0 + 60, 25, 100)]
    live.close()
    assert len(out.getvalue().splitlines()) == 2


def test_status_every_0_writes_nothing(tmp_path: Path) -> None:
    path, out, clock = tmp_path / layout.EVENTS, io.StringIO(), Clock(T0)
    path.write_bytes(b"".join(encode(e) for e in RUN))
    for tty in (False, True):
        live = LiveView(path, out, every_seconds=0, tty=tty, clock=clock)
        clock.now += 100
        live.tick()
        live.around(lambda line: None)("launcher line")
        live.close()
    assert out.getvalue() == ""


def test_on_a_terminal_one_line_is_rewritten_in_place_and_launcher_lines_go_above_it(tmp_path: Path) -> None:
    path, out, clock = tmp_path / layout.EVENTS, io.StringIO(), Clock(T0)
    live = LiveView(path, out, every_seconds=30, tty=True, clock=clock)
    printed: list[str] = []
    say = live.around(lambda line: printed.append(out.getvalue()) or out.write(line + "\n"))
    path.write_bytes(encode(RUN[0]) + encode(RUN[1]))
    live.tick()
    assert out.getvalue().startswith("\r\x1b[Krunning: step 10, epoch 0") and "\n" not in out.getvalue()
    live.tick()  # within the refresh period: nothing new
    assert out.getvalue().count("\r") == 1
    say("attempt 1: ...")
    assert printed[0].endswith("\r\x1b[K"), "the status line is erased before the launcher's line"
    shown = out.getvalue().split("\r\x1b[K")[1]  # the status line drawn by the first tick
    assert out.getvalue().endswith("attempt 1: ...\n\r\x1b[K" + shown), "and drawn again below it"
    clock.now += 1
    append(path, encode(RUN[2]))
    live.tick()
    assert out.getvalue().rsplit("\r\x1b[K", 1)[1].startswith("running: step 20, epoch 0")
    live.close()
    assert out.getvalue().endswith("\n")
