"""Browser test job: every rank prints and logs a step every 0.5 s until someone stops it.

The interrupt test stops it from JupyterLab's toolbar. The cap of 600 steps (5 minutes) only
matters if that stop fails: no test run can leave it running for ever.
"""
import time

from gpucourse import runtime

ctx = runtime.setup()
for step in range(600):
    print(f"rank {ctx.rank} step {step}", flush=True)
    runtime.log(step=step)
    time.sleep(0.5)
runtime.teardown()
