"""What chapter 08b (hangs and desyncs) shows, `gpucourse/chapters/ch08b.py`, built from hand-made records."""
import pandas as pd

from gpucourse.chapters import ch08b


def test_diagnoses_show_each_runs_fault_and_whom_it_blames():
    from gpucourse.run.forensics import Diagnosis

    class Run:  # what diagnoses reads of a RunResult
        def __init__(self, status, found):
            self.status, self.world_size, self.found = status, 4, found

        def diagnosis(self):
            return self.found

    df = ch08b.diagnoses({"skip": Run("failed", Diagnosis([1], "all_reduce", 4, "missing")),
                           "fine": Run("ok", None)})
    assert df.loc["skip", "kind"] == "missing" and df.loc["skip", "blamed rank(s)"] == [1]
    assert df.loc["skip", "collective"] == "all_reduce #4"
    assert df.loc["fine", "ended"] == "ok" and pd.isna(df.loc["fine", "kind"])


def test_shard_batches_reads_the_line_each_rank_prints_before_it_trains():
    class Run:  # what shard_batches reads of a RunResult
        world_size = 3
        logs = {0: "rank 0: 7 training batches\nrank 0: step 0\n", 1: "rank 1: 4 training batches\n", 2: ""}

        def log(self, rank):
            return self.logs[rank]

    assert ch08b.shard_batches(Run()) == {0: 7, 1: 4}  # rank 2 printed nothing (died before): left out
