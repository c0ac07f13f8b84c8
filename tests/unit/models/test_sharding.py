"""Chapter 07's run analysis (gpucourse.models.sharding), on hand-made records: formulas, shares, faults, groups."""
import pytest

from gpucourse.models import costs, sharding
from gpucourse.models.memory import model_states


def _memory_metrics(world, numel=1000, ranks_differ=False):
    """Records as scripts/07_memory.py logs them, every mode holding exactly what its stage says (fp32 AdamW)."""
    metrics = {}
    for rank in range(world):
        recs = []
        for mode, stage in sharding.STAGES.items():
            m = model_states(numel, world, stage, optimizer="adamw", precision="fp32")
            extra = 16  # AdamW's step counters: 4 bytes per tensor, on every rank
            recs.append({"mode": mode, "num_params": numel, "params": m["parameters"] + (rank if ranks_differ else 0),
                         "grads": m["gradients"], "optimizer": m["optimizer states"] + extra,
                         "max_diff_vs_ddp": 0.0 if rank == 0 else None,
                         "impl": "solutions/x.py" if mode == "fsdp" else None})
        metrics[rank] = recs
    return metrics


def test_measured_states_takes_the_largest_rank_and_the_stage_formula():
    rows = sharding.measured_states({2: _memory_metrics(2, ranks_differ=True)})
    assert [r["mode"] for r in rows] == list(sharding.STAGES)
    ddp = rows[0]
    assert ddp["measured"]["params"] == 4000 + 1  # rank 1 held one byte more: the max over ranks
    assert ddp["model"]["total"] == 16 * 1000 and ddp["total"] == 16 * 1000 + 1 + 16
    assert rows[-1]["impl"] == "solutions/x.py"


def test_sharding_faults_names_a_mode_that_does_not_shard_as_its_stage_says():
    rows = sharding.measured_states({4: _memory_metrics(4, numel=100_000)})
    assert sharding.sharding_faults(rows) == []
    shares = sharding.share_of_ddp(rows)
    assert shares[4, "fsdp2"] == {"params": 0.25, "grads": 0.25, "optimizer": pytest.approx(0.25, rel=1e-3)}
    bad = [dict(r, measured=dict(r["measured"], optimizer=r["measured"]["optimizer"] * 4)) if r["mode"] == "zero1"
           else r for r in rows]
    assert len(sharding.sharding_faults(bad)) == 1 and "ZeRO-1" in sharding.sharding_faults(bad)[0]
    fat_ddp = [dict(r, total=r["total"] * 2) if r["mode"] == "ddp" else r for r in rows]
    assert "DDP held" in sharding.sharding_faults(fat_ddp)[0]


def test_fewest_devices_and_never_for_zero1s_replicated_part():
    assert sharding.fewest_devices(7e9, 3, 80e9) == 2  # 112 GB / 2 = 56 GB
    assert sharding.fewest_devices(70e9, 1, 80e9) is None  # 4 bytes x 70e9 = 280 GB replicated


def _hsdp_records(R, S, numel=64, wrong_rank=None):
    P, world = 4 * numel, R * S
    shapes = {"ddp": (world, 1), "fsdp": (1, world), "hsdp": (R, S)}
    groups = {"ddp": {"replicate": list(range(world))}, "fsdp": {"shard": list(range(world))},
              "hsdp": {"shard": [0, 1], "replicate": [0, 2]}}
    records = {}
    for v, (r, s) in shapes.items():
        m = model_states(numel, world if v == "ddp" else s, 0 if v == "ddp" else 3, optimizer="adamw", precision="fp32")
        formula = costs.sharded_dp_comm_bytes(P, r, s)
        for rank in range(world):
            calls = [{"op": op, "group": f["group"], "ranks": groups[v][f["group"]],
                      "bytes": f["calls_bytes"] + (1 if rank == wrong_rank and v == "hsdp" else 0)}
                     for op, f in formula.items()]
            records[v, rank] = {"num_params": numel, "params": m["parameters"], "grads": m["gradients"],
                                "optimizer": m["optimizer states"], "losses": [1.0, 0.5],
                                "ref_losses": [1.0, 0.5 + 1e-7],
                                "max_param_diff": 1e-7, "calls": calls}
    return records, shapes, P


def test_hsdp_states_and_comm_against_the_formulas_and_the_node_boundary():
    records, shapes, P = _hsdp_records(2, 2)
    rows = sharding.hsdp_states(records, shapes, {"ddp": 0, "fsdp": 3, "hsdp": 3})
    assert all(r["measured"] == r["model"] for r in rows) and rows[0]["loss diff"] == pytest.approx(1e-7)
    comm, faults = sharding.hsdp_comm(records, shapes, P)
    assert faults == [] and set(comm) == set(shapes)
    cross = sharding.cross_node_sent(comm, ranks_per_node=2)
    assert cross["hsdp"] == comm["hsdp"]["all_reduce"]["sent"]  # only the replicate group crosses nodes
    assert cross["fsdp"] == sum(f["sent"] for f in comm["fsdp"].values())  # all of FSDP's groups span both nodes
    records, shapes, P = _hsdp_records(2, 2, wrong_rank=3)
    assert [f.split(":")[0] for f in sharding.hsdp_comm(records, shapes, P)[1]] == ["hsdp rank 3"]


def test_fsdp2s_dim0_shards_are_torch_chunks_pieces_the_last_rank_holding_the_rest():
    import torch

    from gpucourse.models.sharding import dim0_shard_rows
    for rows, world in ((16032, 128), (10, 4), (3, 4), (8, 8), (0, 2)):
        pieces = [len(c) for c in torch.arange(rows).chunk(world)] if rows else []
        pieces += [0] * (world - len(pieces))  # torch.chunk returns fewer pieces when rows run out
        assert [dim0_shard_rows(rows, world, r) for r in range(world)] == pieces
    assert dim0_shard_rows(16032, 128, 127) == 30 and dim0_shard_rows(16032, 128, 0) == 126
    with pytest.raises(ValueError, match="rank"):
        dim0_shard_rows(10, 4, 4)
