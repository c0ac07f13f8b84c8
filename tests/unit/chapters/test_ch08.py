"""What chapter 08 (multi-node, faults, checkpoints that reshard) shows, `gpucourse/chapters/ch08.py`, built from
hand-made records."""
import pytest

from gpucourse.chapters import ch08


# --- chapter 08 ---------------------------------------------------------------------------------------
def test_whoami_has_a_row_per_rank_in_rank_order():
    def me(rank, node):
        return [{"RANK": rank, "GROUP_RANK": node, "LOCAL_RANK": rank % 2, "WORLD_SIZE": 4, "agent_pid": 100 + node,
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29500}, {"ranks_seen": [0, 1, 2, 3]}]
    df = ch08.whoami({3: me(3, 1), 0: me(0, 0), 1: me(1, 0), 2: me(2, 1)})
    assert list(df.index) == [0, 1, 2, 3] and df.index.name == "RANK"
    assert list(df.columns) == ["GROUP_RANK", "LOCAL_RANK", "WORLD_SIZE", "agent pid", "rendezvous"]
    assert df.loc[3, "GROUP_RANK"] == 1 and df.loc[3, "agent pid"] == 101 and df.loc[2, "rendezvous"] == "127.0.0.1:29500"


def test_process_outcomes_show_each_exit_and_the_exception_line():
    out = {"right": [(0, "rank 0 ok\n"), (0, "rank 1 ok\n")],
           "wrong port": [(1, "Traceback:\n  x\ntorch.distributed.DistStoreError: Timed out after 10s\n[W] frames")]}
    df = ch08.process_outcomes(out)
    assert list(df.columns) == ["exit code", "last words"]
    assert df.loc[("right", 1), "last words"] == "rank 1 ok"
    assert df.loc[("wrong port", 0), "exit code"] == 1
    assert df.loc[("wrong port", 0), "last words"] == "torch.distributed.DistStoreError: Timed out after 10s"


def test_placement_gives_milliseconds_and_the_ratio():
    df = ch08.placement({"TP": (0.00123, 0.0246), "DP": (0.5, 2.0)})
    assert list(df.columns) == ["inside a node (ms)", "across nodes (ms)", "across / inside (×)"]
    assert df.loc["TP", "inside a node (ms)"] == 1.2 and df.loc["TP", "across nodes (ms)"] == 24.6
    assert df.loc["TP", "across / inside (×)"] == 20 and df.loc["DP", "across / inside (×)"] == 4


def test_attempt_logs_read_every_attempts_folder(tmp_path):
    class Run:  # what attempt_logs reads of a RunResult
        run_dir = tmp_path

        def log(self, rank, attempt):
            return f"attempt {attempt} rank {rank} step 1\nstep 2\n"

    for k in (0, 1):
        (tmp_path / "logs" / f"attempt{k}").mkdir(parents=True)
    df = ch08.attempt_logs(Run(), ranks=2)
    assert list(df.index) == [(0, 0), (0, 1), (1, 0), (1, 1)] and list(df.columns) == ["printed"]
    assert df.loc[(1, 0), "printed"] == "attempt 1 rank 0 step 1 | step 2"


def run(rule, lr, accs, losses, final_loss=0.5):
    head = {"global_batch": 64, "base_lr": 0.1, "target_lr": lr}
    pts = [{"epoch": e, "opt_step": 10 * i, "step_losses": ls, "test_acc": a, "test_loss": final_loss,
            "seconds": 1.25 * i} for i, (e, a, ls) in enumerate(zip((0.0, 0.5, 1.0, 2.0), accs, losses))]
    return {"header": {**head, "rule": rule}, "points": pts}


# --- chapter 08: checkpoints that reshard -----------------------------------------------------------------------------
def test_reshard_compares_losses_and_sample_ids_and_counts_repeats():
    def run(losses, batches, first=0, **extra):
        return [{"step": first + s, "loss": loss, "ids": ids, "layout": "fsdp", "world": 4, **extra}
                for s, (loss, ids) in enumerate(zip(losses, batches))] + [{"event": "setup"}]
    batches = [[0, 1], [2, 3], [4, 5], [6, 7]]
    reference = run([4.0, 3.0, 2.0, 1.0], batches)
    exact = run([2.0, 1.0 + 1e-12], batches[2:], first=2, world=2)
    dropped = run([2.5, 1.5], batches[:2], first=2)  # the loader started again at sample 0
    df = ch08.reshard(reference, {"exact": exact, "dropped": dropped}, save_at=1)
    assert df.loc["exact", "world"] == 2 and df.loc["exact", "steps after the save"] == 2
    assert 0 < df.loc["exact", "max |loss − uninterrupted|"] < 1e-11
    assert df.loc["exact", "steps with the same sample ids"] == 2
    assert df.loc["exact", ["samples repeated", "samples skipped"]].tolist() == [0, 0]
    assert df.loc["dropped", "steps with the same sample ids"] == 0
    assert df.loc["dropped", ["samples repeated", "samples skipped"]].tolist() == [4, 4]
    assert df.loc["dropped", "max |loss − uninterrupted|"] == 0.5
    with pytest.raises(ValueError, match="no step records"):
        ch08.reshard(reference, {"failed": [{"event": "setup"}]}, save_at=1)
    with pytest.raises(ValueError, match="must run past step"):
        ch08.samples_out_of_place(reference[:2], exact, save_at=1)
