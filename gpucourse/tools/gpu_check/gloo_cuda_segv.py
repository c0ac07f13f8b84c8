"""Chapter 07's SIGSEGV: gloo ranks sharing a GPU with CUDA tensors, run until one crashes, and the collective its
faulthandler stack names."""
from __future__ import annotations

import re
from pathlib import Path

from .harness import SCRIPTS, job_devices, launch, needs, seconds_left


# --- chapter 07's SIGSEGV: gloo ranks sharing a GPU with CUDA tensors ----------------------------------------
_FH_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)[^\n]*\(most recent call first\):", re.M)
_FH_FRAME = re.compile(r'^\s+File "([^"]+)", line (\d+) in (\S+)')


def faulthandler_stacks(text: str) -> list[dict]:
    """The Python stacks faulthandler printed after a fatal signal, one per thread, innermost frame first:
    [{"thread", "current", "frames": [{"file", "line", "function"}]}]; [] when there is none."""
    start = text.find("Fatal Python error")
    if start < 0:
        return []
    chunk = text[start:]
    heads = list(_FH_THREAD.finditer(chunk))
    stacks = []
    for i, head in enumerate(heads):
        body = chunk[head.end():heads[i + 1].start() if i + 1 < len(heads) else len(chunk)]
        frames = []
        for line in body.splitlines()[1:]:
            m = _FH_FRAME.match(line)
            if m:
                frames.append({"file": m.group(1), "line": int(m.group(2)), "function": m.group(3)})
            elif line.strip() and not line.strip().startswith("<"):
                break  # the end of this stack ("Extension modules: ..." and the like)
        stacks.append({"thread": head.group(2), "current": head.group(1) == "Current thread", "frames": frames})
    return stacks


def innermost_distributed_call(stacks: list[dict]) -> dict | None:
    """The innermost torch.distributed frame, in the crashing (current) thread if it has one, else in any thread,
    with the course script's own innermost frame beside it."""
    for stack in sorted(stacks, key=lambda s: not s["current"]):
        for i, frame in enumerate(stack["frames"]):
            if "torch/distributed" in frame["file"].replace("\\", "/"):
                own = next((f for f in stack["frames"][i:] if "site-packages" not in f["file"]
                            and "/torch/" not in f["file"]), None)
                return {"call": f"{frame['function']} ({frame['file'].split('site-packages/')[-1]}:{frame['line']})",
                        "thread": "crashing thread" if stack["current"] else f"thread {stack['thread']}",
                        "from": f"{own['function']} ({Path(own['file']).name}:{own['line']})" if own else None}
    return None


SEGV_MODES = ("ddp", "zero1", "sharded", "fsdp2", "fsdp")


@needs(40)
def check_gloo_cuda_segv(runs: int = 3, nproc: int = 2, width: int = 128, depth: int = 4, steps: int = 2):
    """Chapter 07's ZeRO/FSDP script with gloo ranks sharing the GPU and holding CUDA tensors (--cuda-with-gloo),
    faulthandler on: the crashing rank's Python stack names the collective. Up to `runs` runs, until one crashes."""
    figures: dict = {"runs": []}
    diagnosis = None
    for i in range(runs):
        left = seconds_left()
        if i and left is not None and left < 20:
            break
        res = launch(SCRIPTS / "07_memory.py", nproc=nproc, backend="gloo", name=f"gpucheck-gloo-cuda-segv-{i}",
                      timeout=120, env={"PYTHONFAULTHANDLER": "1"},
                      args=["--cuda-with-gloo", "--modes", *SEGV_MODES, "--width", width, "--depth", depth,
                            "--steps", steps])
        run = {"run": str(res.run_dir), "status": res.status, "error": str(res.error)[:500] if res.error else None,
               "modes_done": [m["mode"] for m in res.metrics.get(0, []) if "mode" in m], "ranks": {}}
        for rank in range(nproc):
            err = res.log(rank, "stderr")
            stacks = faulthandler_stacks(err)
            call = innermost_distributed_call(stacks)
            run["ranks"][rank] = {"fatal": next((ln for ln in err.splitlines() if ln.startswith("Fatal Python error")),
                                                None), "call": call,
                                  "stack": [f"{Path(f['file']).name}:{f['line']} {f['function']}"
                                            for s in stacks if s["current"] for f in s["frames"]][:25],
                                  "other_threads": [[f"{Path(f['file']).name}:{f['line']} {f['function']}"
                                                     for f in s["frames"][:8]] for s in stacks if not s["current"]][:4]}
            if call and diagnosis is None:
                diagnosis = (f"run {i + 1}: rank {rank} died ({run['ranks'][rank]['fatal']}) in {call['call']}"
                             f", called from {call['from']}, in the {call['thread']}; modes finished before it: "
                             f"{', '.join(run['modes_done']) or 'none'}")
        with_devices = job_devices(res.run_dir.parent)
        run["rank_devices"] = next((j["rank_devices"] for j in with_devices if j["name"] == res.run_dir.name), [])
        figures["runs"].append(run)
        print(f"  run {i + 1}: {res.status}, modes done {run['modes_done']}, devices {run['rank_devices']}", flush=True)
        if not res.ok:
            break
    figures["diagnosis"] = diagnosis
    last = figures["runs"][-1] if figures["runs"] else {}
    if diagnosis:
        return True, diagnosis, figures
    if figures["runs"] and all(r["status"] == "ok" for r in figures["runs"]):
        return True, (f"did not crash in {len(figures['runs'])} run(s) of {nproc} gloo ranks with CUDA tensors "
                      f"(devices {last.get('rank_devices')}), modes {', '.join(SEGV_MODES)}"), figures
    return False, f"failed without a faulthandler stack: {last.get('status')} {last.get('error')}", figures
