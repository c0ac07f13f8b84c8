#!/usr/bin/env bash
# One prepared GPU run of `gpucourse gpu-check` on a bare lent machine (Python 3.12 + its own torch, no network).
#
#   bash docs/gpu-run.sh [OUT] [BUDGET_S]      OUT defaults to $OUT, BUDGET_S to 520
#
# Needs the wheels in .whl/ (papermill, ipykernel, ipywidgets, nbformat, nbclient and what they need that the
# machine lacks: docs/gpu-wheels.txt, for its Python 3.12), fetched here once with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -r docs/gpu-wheels.txt
# Writes into OUT, as it goes:
#   results.jsonl   one line per check outcome (and per notebook) the moment it is known
#   log.txt         everything printed
#   gpu-check-*.md/.json   the report of every outcome in results.jsonl (written at the end)
#   artifacts.tar.gz       every run's manifest, exit records and logs; notebooks.tar.gz the executed notebooks
# Phase 1 runs every chapter (09 at default sizes, the others at smoke sizes, 4 at a time) beside the graders,
# the dry run against the allocator and chapter 05's schedules one by one; phase 2 the capstone's timings alone.
# A failing check never stops the others; no check starts once the budget is spent (or when it would not fit).
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-${OUT:?give OUT}}
BUDGET=${2:-520}
START=$(date +%s)
DEADLINE=$((START + BUDGET))
mkdir -p "$OUT"
LOG="$OUT/log.txt"
exec > >(tee -a "$LOG") 2>&1
echo "gpu-run: $(date -u +%FT%TZ), budget ${BUDGET} s, repo $REPO"

# --- setup: wheels into /tmp/site, the gpucourse shim, the notebooks' kernel -------------------------------
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$REPO"/.whl/*.whl || { echo "gpu-run: wheel install FAILED"; }
export PYTHONPATH=/tmp/site:$REPO PYTHONUNBUFFERED=1 GPUCOURSE_RUNS_DIR=/tmp/runs
mkdir -p /tmp/bin /tmp/runs
printf '#!/bin/sh\nexec python3 -m gpucourse.tools.cli "$@"\n' > /tmp/bin/gpucourse && chmod +x /tmp/bin/gpucourse
export PATH=/tmp/bin:/tmp/site/bin:$PATH
python3 -m ipykernel install --user --name gpucourse --display-name "Python (gpucourse)" \
    || echo "gpu-run: kernel install FAILED"
python3 - <<'PY' || echo "gpu-run: import check FAILED"
import importlib, torch
for m in ("papermill", "nbclient", "nbformat", "ipykernel", "ipywidgets", "zmq", "tornado", "jupyter_client", "gpucourse"):
    mod = importlib.import_module(m); print(f"  {m} {getattr(mod, '__version__', '')}")
print(f"  torch {torch.__version__}, cuda {torch.cuda.is_available()}, {torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-'}")
PY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
{ env | grep -E '^(TORCH|GLOO|NCCL|CUDA|OMP|PYTORCH)' | sort; python3 -c "import inspect, torch.distributed.pipelining.schedules as s
print(inspect.getsource(s.PipelineScheduleMulti._initialize_stages))"; } > "$OUT/env.txt" 2>&1
echo "gpu-run: setup took $(( $(date +%s) - START )) s"

R="$OUT/results.jsonl"
check() {  # gpucourse gpu-check with the shared deadline and results file; never stops the script
    local left=$(( DEADLINE - $(date +%s) + 30 ))
    [ "$left" -gt 30 ] || { echo "gpu-run: no budget left for gpu-check $*"; return 0; }
    timeout -k 10 "$left" gpucourse gpu-check --deadline "$DEADLINE" --results "$R" \
        --report-dir /tmp/gpucheck-reports "$@" || echo "gpu-run: gpu-check $* exited $?"
}

# --- phase 1: every chapter (09 at its default sizes, the rest at smoke sizes) beside the CPU-side checks ----------
P1=$((START + BUDGET * 60 / 100))  # phase 1 starts nothing after this; the timing checks need the rest
( DEADLINE=$P1; check --only notebooks --notebooks default --notebook 09 ) &
NB9=$!
( DEADLINE=$P1; check --only notebooks --notebook-except 09 --notebook-workers 4 ) &  # all but 09: new chapters too
NB=$!
( DEADLINE=$P1; check --only graders dryrun_memory pipeline_schedules )
wait $NB9 $NB
echo "gpu-run: phase 1 done at $(( $(date +%s) - START )) s"

# --- phase 2: alone on the GPU (timings) ------------------------------------------------------------------
check --only capstone_compiled
echo "gpu-run: phase 2 done at $(( $(date +%s) - START )) s"

# --- the report and the artifacts ---------------------------------------------------------------------------
gpucourse gpu-check --report-from "$R" --report-dir "$OUT" || true
FILES=$(cd / && { find tmp/runs tmp/gpucheck-grade-* -maxdepth 5 \
    \( -name manifest.json -o -name 'exit*.json' -o -name 'agent*.log' -o -name '*.stderr' -o -name '*.stdout' \) \
    -size -1M 2>/dev/null; })
[ -n "$FILES" ] && (cd / && tar -czf "$OUT/artifacts.tar.gz" $FILES 2>/dev/null)
(cd "$REPO" && tar -czf "$OUT/notebooks.tar.gz" executed/gpu-check 2>/dev/null)
ls -la "$OUT"
echo "gpu-run: done in $(( $(date +%s) - START )) s"
