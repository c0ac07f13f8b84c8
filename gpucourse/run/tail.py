"""In the launcher's process: follow a run directory while it is written, new whole lines from every rank's logs, new
metrics."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .contract import STREAMS, agent_logs, attempt_dir, latest_attempt, logs_dir, metrics_files, rank_of_file


@dataclass
class Line:
    rank: int | None  # None: torchrun's agent
    stream: str  # "stdout" | "stderr"
    text: str


class _Follower:
    """Reads only complete lines, so a rank writing half a line is never shown cut in two."""

    def __init__(self, path: Path):
        self.path, self.offset, self.partial = path, 0, b""

    def read(self, final: bool = False) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(1 << 20)  # at most 1 MiB per poll: a flooding rank cannot stall us
        except OSError:
            return []
        self.offset += len(data)
        data = self.partial + data
        *lines, self.partial = data.split(b"\n")
        if final and self.partial:
            lines, self.partial = lines + [self.partial], b""
        return [ln.decode(errors="replace").rstrip("\r") for ln in lines]


def _reading_order(path: Path) -> tuple:
    """Ranks in order, and a rank's stdout before its stderr; agents' logs last. Lines that reach one poll from
    both streams of a rank cannot be timed against each other: this puts what a rank printed before the traceback
    it died with (the usual order), where reading stderr first (its name sorts first) turned it around."""
    parsed = rank_of_file(path)
    if parsed is None or parsed[1] not in STREAMS:
        return (1, 0, 0, str(path))
    return (0, parsed[0], STREAMS.index(parsed[1]), str(path))


class RunTailer:
    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.logs: dict[Path, _Follower] = {}
        self.metrics: dict[Path, _Follower] = {}
        self.last_line: dict[int, str] = {}

    def _discover(self) -> None:
        attempt = latest_attempt(self.run_dir)
        for path in attempt_dir(logs_dir(self.run_dir), attempt).glob("rank*.std*") if attempt is not None else []:
            self.logs.setdefault(path, _Follower(path))
        for path in agent_logs(self.run_dir):
            self.logs.setdefault(path, _Follower(path))
        for path in metrics_files(self.run_dir).values():
            self.metrics.setdefault(path, _Follower(path))

    def poll(self, final: bool = False) -> tuple[list[Line], list[dict]]:
        """New log lines (all ranks) and new metric records since the last call."""
        self._discover()
        lines: list[Line] = []
        for path, follower in sorted(self.logs.items(), key=lambda item: _reading_order(item[0])):
            parsed = rank_of_file(path)
            rank, stream = parsed if parsed and parsed[1] in STREAMS else (None, "stderr")  # None: an agent's log
            for text in follower.read(final):
                lines.append(Line(rank, stream, text))
                if rank is not None and text.strip():
                    self.last_line[rank] = text.strip()
        records = []
        for follower in self.metrics.values():
            for text in follower.read(final):
                try:
                    records.append(json.loads(text))
                except ValueError:
                    continue
        return lines, records
