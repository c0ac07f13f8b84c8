"""The launcher's stall rule, on a clock of its own: slow start-up on a busy machine is not a stall."""
from types import SimpleNamespace

from gpucourse.run import launcher


class Clock:
    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


class SilentJob:
    """Ranks that start at the given times and never print; the agents never end."""

    def __init__(self, clock, rank_starts):
        self.clock, self.rank_starts, self.started, self.ranks = clock, rank_starts, 0.0, {}

    def track(self):
        self.ranks = {pid: pid for pid, t in enumerate(self.rank_starts) if t <= self.clock.now}

    def finished(self):
        return False

    def running_ranks(self):
        return sorted(self.ranks.values())

    def all_ranks_ended(self):
        return False


def stalled_at(monkeypatch, rank_starts, stall_timeout=8.0):
    clock = Clock()
    monkeypatch.setattr(launcher, "time", clock)
    plan = SimpleNamespace(timeout=None, stall_timeout=stall_timeout)
    tailer = SimpleNamespace(poll=lambda: ([], []))
    view = SimpleNamespace(update=lambda *a: None)
    stop = launcher._supervise(plan, SilentJob(clock, rank_starts), tailer, view)
    assert stop.status == "stalled"
    return clock.now


def test_start_up_grace_counts_from_the_last_rank_started(monkeypatch):
    grace = 8.0 + launcher.STARTUP_GRACE_S
    # the agent took 40 s to start its ranks (a loaded machine): their grace starts then, not at the launch
    assert abs(stalled_at(monkeypatch, [40.0, 40.0, 41.0, 41.0]) - (41.0 + grace)) < 0.5
    # ranks that never appear: the launch itself is the start
    assert abs(stalled_at(monkeypatch, []) - grace) < 0.5
