"""The whole course in smoke mode: total time and the slowest notebooks (budget: 15 min in all, 3 min each).

    python benchmarks/course_smoke.py
"""
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gpucourse.tools.course import run_course, table  # noqa: E402

os.environ.setdefault("GPUCOURSE_RUNS_DIR", tempfile.mkdtemp(prefix="course-smoke-runs-"))
results = run_course(smoke=True, output=Path(tempfile.mkdtemp(prefix="course-smoke-")))
print(table(results))
total = sum(r.duration for r in results)
print("\nslowest:", ", ".join(f"{r.notebook} {r.duration:.0f} s" for r in sorted(results, key=lambda r: -r.duration)[:3]))
print(f"total {total:.0f} s (budget 900 s); over 180 s: {[r.notebook for r in results if r.duration > 180] or 'none'}")
sys.exit(0 if all(r.status == "ok" for r in results) else 1)
