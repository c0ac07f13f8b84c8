"""What a person reads of a dry run (gpucourse dryrun): the report as text, in the course's units."""
from __future__ import annotations

from pathlib import Path

from ..models.units import human_bytes, human_si


def dryrun_text(result: dict) -> str:
    """Per simulated rank: the step's memory peak and parts, FLOPs, what the script assumed (ASSUMED), the
    modelled step time where the result has one ("predicted", labelled MODELLED), and every collective with its
    group, calls and bytes."""
    tensors = "; fake tensors: no storage behind them" if result.get("fake_tensors") else ""
    lines = [f"dry run of {Path(result['script']).name} at world {result['world']:,} (fake process group{tensors}: "
             "memory, FLOPs and bytes counted, not measured; a step time, where shown, is modelled)"]
    for r in result["ranks"]:
        parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in r["memory"].items())
        lines.append(f"rank {r['rank']}, step {r['step']}: peak {human_bytes(r['peak_bytes'])} ({parts}); "
                     f"{human_si(r['flops'], 'FLOP')}")
        for text in r.get("assumptions", []):
            lines.append(f"  ASSUMED: {text}")
        if r.get("predicted"):
            p = r["predicted"]
            lines.append(f"  MODELLED on {p['system']} ({p['device']}, {p['dtype']}): step {p['step_s'] * 1e3:.3g} ms "
                         f"(compute {p['compute_s'] * 1e3:.3g} ms + communication {p['comm_s'] * 1e3:.3g} ms), MFU "
                         f"{p['mfu']:.1%}; assumes {p['assumes']}")
        for c in r["comms"]:
            group = c["group"] or []
            shown = (f"{group[:4]}"[:-1] + ", ...]" if len(group) > 4 else f"{group}")
            peers = f" peers {c['peers']}" if "peers" in c else ""
            lines.append(f"  {c['op']:<24} group of {c['group_size']:>5} {shown}{peers}: {c['calls']} call(s), "
                         f"{human_bytes(c['bytes'])}")
    return "\n".join(lines)
