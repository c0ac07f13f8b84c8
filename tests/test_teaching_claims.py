"""Claims the chapters make about PyTorch itself, checked against the installed PyTorch by real runs."""
from gpucourse import launch

from .conftest import JOBS


def test_ddp_default_bucket_cap_has_a_small_first_bucket_and_an_explicit_cap_does_not(runs_dir):
    """Chapter 03: bucket_cap_mb=None means 25 MiB buckets after a 1 MiB first one; passing 25 means one cap for all."""
    result = launch(JOBS / "ddp_buckets.py", nproc=2, live=False, timeout=180)
    buckets = {rec["cap"]: rec["bucket_bytes"] for rec in result.metrics[0]}
    model_bytes = 6 * (512 * 512 + 512) * 4
    assert sum(buckets[None]) == sum(buckets[25]) == model_bytes
    assert len(buckets[None]) == 2 and 2**20 <= buckets[None][0] < 2 * 2**20  # the last layer alone, ~1 MiB
    assert buckets[25] == [model_bytes]  # 6.3 MB < 25 MiB: one bucket, ready only when backward ends
