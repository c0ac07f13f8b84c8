"""Interactive tools of chapter 03: browse the profiled runs, and model DDP scaling far beyond this machine.

    from gpucourse.viz.widgets import run_explorer, scaling_simulator
    run_explorer()                          # pick a run with traces: timeline, breakdown, per-rank table
    scaling_simulator(measured={"compute_s": 0.04, "alpha": 2e-4, "beta": 1e-9, "grad_bytes": 6.3e6})

The simulator draws `gpucourse.models.scaling.simulate`'s numbers (DDP weak scaling, the model's docstring says
what it leaves out).

Both widgets draw into an Output by setting its outputs (one list, see show_in), not with `with out:`, so they
work the same in JupyterLab, under papermill and in plain Python (tests), from any thread.
"""
from __future__ import annotations

import html
import io
import math
import re
import threading
from pathlib import Path

from ..models import costs, planner
from ..models.scaling import check_positive, simulate, turning_point
from ..models.memory import OPTIMIZER_LABELS, PARTS, PRECISION_LABELS, STAGE_NAMES, gb, largest_model, stages_table
from ..models.traces import TraceError, analyze_run
from ..models.units import human_percent, human_seconds, human_si
from ..run.contract import traces_dir
from ..run.result import list_runs
from . import timeline
from .plots import plan_plot, stages_plot

FITTED = "your fitted α–β (this machine)"
WORLD_SIZES = [2**k for k in range(15)]  # 1 … 16384: the simulator's world-size choices


def simulation_plot(curves: dict, *, title: str = "", measured: dict | None = None):
    """Modelled throughput and efficiency against world size for each {label: simulate() rows}
    (timeline.throughput_efficiency_plot). Each curve's turning point (first communication-bound N) is a
    vertical dotted line, and named in the legend. measured: optional {N: efficiency} drawn as dots."""
    labelled, points = {}, {}
    for label, rows in curves.items():
        point = turning_point(rows)
        label += f" — comm-bound from N = {point}" if point else " — compute-bound throughout"
        labelled[label], points[label] = rows, point
    fig = timeline.throughput_efficiency_plot(
        labelled, log=True, vlines=points, measured=measured,
        title=title or "DDP weak scaling, modelled (α–β ring all-reduce, bucketed)")
    ax_t, ax_e = fig.axes
    ax_e.axhline(50, color="0.6", ls=":", lw=1)
    ax_e.text(min(r["world_size"] for rows in curves.values() for r in rows), 51,
              "50 %: exposed comm = compute (beyond: comm-bound)", fontsize=7, color="0.4")
    ax_t.set(xlabel="world size N (GPUs)", title="Throughput (modelled)")
    ax_e.set(xlabel="world size N (GPUs)", title="Efficiency = throughput / (N × one GPU's), modelled")
    return fig


# --- drawing into an Output widget ---------------------------------------------------------------------
PNG_DPI = 90
PNG_MAX_WIDTH_PX = 900  # JupyterLab's output area in a 1366-pixel-wide window: wider images are shrunk, text blurs


def _png(fig):
    """The figure as an IPython Image: displays anywhere, with no pyplot and no inline backend needed.

    Drawn at most PNG_MAX_WIDTH_PX wide (a lower dpi for wide figures), so the browser shows it at its own size."""
    from IPython.display import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=min(PNG_DPI, PNG_MAX_WIDTH_PX / fig.get_figwidth()))
    return Image(data=buf.getvalue(), format="png")


def show_in(out, figures=(), text: str = "") -> None:
    """Replace what `out` shows: the figures, then the text (monospace). Safe from any thread.

    One assignment of the whole list, not a clear followed by appends: with ipykernel 7 and JupyterLab 4.4+, a
    widget's messages from the browser are handled on a kernel subshell, in another thread than the cell, so two
    redraws can run at once, and clear, clear, append, append would show the plot twice."""
    from IPython.core.interactiveshell import InteractiveShell

    fmt = InteractiveShell.instance().display_formatter.format
    outputs = []
    for fig in figures:
        data, metadata = fmt(_png(fig))
        outputs.append({"output_type": "display_data", "data": data, "metadata": metadata})
    if text:
        outputs.append({"output_type": "stream", "name": "stdout", "text": text + "\n"})
    out.outputs = tuple(outputs)


# --- run explorer ------------------------------------------------------------------------------------
def traced_runs(runs_dir=None) -> list[tuple[str, tuple[str, str]]]:
    """(label, (run_dir, trace name)) for every run with traces, newest first; one entry per trace name
    (runtime.profile(name=...) writes traces/<name><rank>.json; the default name is "rank")."""
    options = []
    for run in reversed(list_runs(runs_dir)):
        names = sorted({m.group(1) for p in traces_dir(run.run_dir).glob("*.json")
                        if (m := re.fullmatch(r"(.*?)(\d+)", p.stem))})
        for name in names:
            label = (f"{run.name}" + ("" if name == "rank" else f" [{name}]")
                     + f" · {run.world_size} rank{'s' if run.world_size != 1 else ''} · {run.status}")
            options.append((label, (str(run.run_dir), name)))
    return options


class RunExplorer:
    """A dropdown of the runs that have traces; picking one shows its timeline, breakdown and table."""

    def __init__(self, runs_dir=None):
        import ipywidgets as w

        self.runs_dir = runs_dir
        self.analysis = None
        self.figures: list = []
        self.dropdown = w.Dropdown(description="run", layout=w.Layout(width="95%"))
        self.refresh_button = w.Button(description="Refresh", tooltip="list the runs again")
        self.out = w.Output()
        self.widget = w.VBox([w.HBox([self.dropdown, self.refresh_button]), self.out])
        self._quiet = False  # True while refresh() rebuilds the list: one redraw at the end, not one per change
        self.dropdown.observe(lambda change: None if self._quiet else self.show(change["new"]), names="value")
        self.refresh_button.on_click(lambda _: self.refresh())
        self.refresh()

    def refresh(self) -> None:
        """List the runs again (after launching more); keeps the selection when it still exists."""
        options = traced_runs(self.runs_dir)
        values = [v for _, v in options]
        kept = self.dropdown.value
        self._quiet = True
        try:
            self.dropdown.options = options
            self.dropdown.value = kept if kept in values else (values[0] if values else None)
        finally:
            self._quiet = False
        if not values:
            self.analysis, self.figures = None, []
            root = Path(self.runs_dir) if self.runs_dir else "the runs directory"
            show_in(self.out, text=f"No run with traces in {root} yet: launch a script that profiles its steps "
                                 "(runtime.profile, as chapter 03's scripts/03_ddp_train.py), then press Refresh.")
        elif self.dropdown.value != kept or not self.figures:
            self.show(self.dropdown.value)

    def show(self, value) -> None:
        """Analyse the selected run's traces and draw them."""
        if value is None:
            return
        run_dir, name = value
        try:
            self.analysis = analyze_run(run_dir, name=name)
        except TraceError as err:
            self.analysis, self.figures = None, []
            show_in(self.out, text=f"cannot analyse {Path(run_dir).name}: {err}")
            return
        self.figures = [timeline.timeline_plot(self.analysis), timeline.breakdown_plot(self.analysis)]
        show_in(self.out, self.figures, self.analysis.summary())

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


def run_explorer(runs_dir=None) -> RunExplorer:
    """Browse the runs that have traces (under runs_dir, default the course's runs directory)."""
    return RunExplorer(runs_dir)


# --- scaling simulator -------------------------------------------------------------------------------
class ScalingSimulator:
    """Sliders for the model of `simulate`; shows throughput and efficiency against world size.

    measured: what this machine measured, to start from: compute_s, grad_bytes, alpha, beta (the α–β fit),
    and optionally backward_fraction (backward's share of compute_s; default costs.BACKWARD_FRACTION, 2/3),
    overlap_cost (what an all-reduce beside compute costs it, 0 … 1; default 0, free overlap), batch (per rank), bucket_mb, efficiency ({N: measured efficiency}, drawn as dots with the
    fitted α–β) and label (where it was measured, for the title).
    """

    def __init__(self, measured: dict | None = None):
        import ipywidgets as w

        self.measured = dict(measured or {})
        m = self.measured
        has_fit = "alpha" in m and "beta" in m
        style = {"description_width": "170px"}
        wide = w.Layout(width="560px")
        # step=None on the log sliders: any value, so the browser does not snap the starting value to a grid
        # (ipywidgets' default step of 0.1 in the exponent snaps 8.8 ms to 7.94 ms).
        self.params = w.FloatLogSlider(value=m.get("grad_bytes", 4 * 25.6e6) / 4, base=10, min=5, max=12, step=None,
                                       description="parameters", readout_format=".3g", style=style, layout=wide)
        self.grad_dtype = w.Dropdown(options=[("fp32 (4 B)", 4), ("bf16 / fp16 (2 B)", 2)], value=4,
                                     description="gradient element", style=style,
                                     layout=w.Layout(width="360px"))  # the default 300 px cuts "bf16 / fp16 (2 B)"
        self.compute_ms = w.FloatLogSlider(value=1e3 * m.get("compute_s", 0.1), base=10, min=-1, max=7, step=None,
                                           description="compute per step (ms)", readout_format=".3g",
                                           style=style, layout=wide)
        self.world = w.SelectionRangeSlider(options=WORLD_SIZES, index=(0, 12), description="world sizes",
                                            style=style, layout=wide)
        choices = ([FITTED] if has_fit else []) + list(costs.INTERCONNECTS)
        self.interconnect = w.Dropdown(options=choices, value=choices[0] if has_fit else "InfiniBand NDR 400G",
                                       description="interconnect", style=style, layout=wide)
        self.bucket_mb = w.FloatLogSlider(value=m.get("bucket_mb", 25), base=10, min=-1, max=3, step=None,
                                          description="bucket size (MiB)", readout_format=".3g", style=style,
                                          layout=wide)
        self.overlap = w.Checkbox(value=True, description="overlap all-reduce with backward", style=style,
                                  layout=wide)
        self.backward = w.FloatSlider(value=m.get("backward_fraction", costs.BACKWARD_FRACTION), min=0, max=1,
                                      step=1e-4, description="backward fraction", readout_format=".2f",
                                      tooltip="backward's share of compute per step: what overlap can hide behind",
                                      style=style, layout=wide)  # a short description: 170 px cuts a longer one
        self.overlap_cost = w.FloatSlider(value=m.get("overlap_cost", 0.0), min=0, max=1, step=1e-4,
                                          description="overlap cost", readout_format=".2f", style=style,
                                          layout=wide)  # 0: hidden comm is free (GPU); 1: it costs compute fully
        self.batch = w.BoundedIntText(value=int(m.get("batch", 32)), min=1, max=1 << 20,
                                      description="batch per GPU", style=style)
        self.summary = w.HTML()
        self.out = w.Output()
        self.controls = [self.params, self.grad_dtype, self.compute_ms, self.world, self.interconnect,
                         self.bucket_mb, self.overlap, self.backward, self.overlap_cost, self.batch]
        self.widget = w.VBox([*self.controls, self.summary, self.out])
        self.rows: list[dict] = []
        self.figure = None
        self._rescaling = False
        # Redraws come from the cell's thread and from the browser's messages on a kernel subshell's thread: one
        # at a time, each reading the controls when it starts, so the last redraw shows the latest values.
        self._lock = threading.RLock()
        for control in self.controls:
            control.observe(lambda _: self.update(), names="value")
        self.params.observe(self._compute_follows_params, names="value")
        self.update()

    def _compute_follows_params(self, change) -> None:
        """A bigger model computes for longer: compute per step scales with the parameter count (same batch,
        same shape of model), then the model is redrawn once. Set the compute slider after the parameters to
        model another batch or another device."""
        with self._lock:
            if self._rescaling or not change["old"]:
                return
            self._rescaling = True
            try:
                self.compute_ms.value *= change["new"] / change["old"]
            finally:
                self._rescaling = False
            self.update()

    def _at_measured_model(self) -> bool:
        """Whether the controls still describe the model that was measured (its dots belong on the plot)."""
        m = self.measured
        same = lambda a, b: math.isclose(a, b, rel_tol=1e-3)  # noqa: E731 - the slider may round its last digits
        return (self.interconnect.value == FITTED and "efficiency" in m
                and same(self.params.value * self.grad_dtype.value, m.get("grad_bytes", 4 * 25.6e6))
                and same(self.compute_ms.value, 1e3 * m.get("compute_s", 0.1))
                and same(self.overlap_cost.value, m.get("overlap_cost", 0.0)))

    def link(self) -> tuple[float, float, str]:
        """(alpha, beta, description) of the chosen interconnect."""
        if self.interconnect.value == FITTED:
            where = self.measured.get("label", "this machine")
            return self.measured["alpha"], self.measured["beta"], f"α–β fitted on {where}"
        ic = costs.INTERCONNECTS[self.interconnect.value]
        return ic.alpha, ic.beta, (f"{ic.name} (nominal: {human_si(ic.bandwidth_bytes_per_s, 'B/s')} per "
                                   f"direction, α = {human_seconds(ic.alpha)})")

    def update(self) -> None:
        """Recompute the model from the controls and redraw."""
        with self._lock:
            if self._rescaling:
                return  # _compute_follows_params redraws once both sliders moved
            self._redraw()

    def _redraw(self) -> None:
        alpha, beta, link = self.link()
        lo, hi = self.world.value
        sizes = [n for n in WORLD_SIZES if lo <= n <= hi]
        if sizes[0] != 1:
            sizes = [1] + sizes  # efficiency is relative to one GPU: always model it
        kwargs = dict(params_count=self.params.value, compute_s=self.compute_ms.value / 1e3, world_sizes=sizes,
                      alpha=alpha, beta=beta, bucket_bytes=self.bucket_mb.value * 2**20,
                      bytes_per_param=self.grad_dtype.value, batch_per_gpu=self.batch.value,
                      backward_fraction=self.backward.value, overlap_cost=self.overlap_cost.value)
        self.rows = simulate(**kwargs, overlap=self.overlap.value)
        other = simulate(**kwargs, overlap=not self.overlap.value)
        on = "overlap on" if self.overlap.value else "overlap off"
        off = "overlap off" if self.overlap.value else "overlap on"
        dots = self.measured.get("efficiency") if self._at_measured_model() else None
        self.figure = simulation_plot(
            {f"{on} (chosen)": self.rows, off: other}, measured=dots,
            title=(f"Modelled DDP weak scaling: {self.params.value:.3g} parameters, "
                   f"{self.compute_ms.value:.3g} ms compute/step ({self.backward.value:.0%} backward), "
                   f"{self.bucket_mb.value:.3g} MiB buckets\n{link}"))
        self.summary.value = self.describe()
        show_in(self.out, [self.figure])

    def describe(self) -> str:
        """One paragraph (HTML) on the chosen curve: where it turns communication-bound, the largest N."""
        last, point = self.rows[-1], turning_point(self.rows)
        turn = (f"communication-bound (communication's cost &gt; compute) from <b>N = {point}</b>" if point else
                "compute-bound over the whole range (communication's cost ≤ compute)")
        penalty = f" + overlap cost {human_seconds(last['penalty_s'])}" if last["penalty_s"] else ""
        return (f"<b>Modelled</b>: {turn}. At N = {last['world_size']}: step {human_seconds(last['step_s'])} "
                f"(compute {human_seconds(last['compute_s'])} + exposed comm {human_seconds(last['exposed_s'])}"
                f"{penalty}; all-reduce {human_seconds(last['comm_s'])} in {last['buckets']} bucket(s)), "
                f"efficiency <b>{human_percent(last['efficiency'])}</b>, {last['throughput']:.3g} samples/s.")

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


def scaling_simulator(measured: dict | None = None) -> ScalingSimulator:
    """The scaling simulator, starting from this machine's measurements when given (see ScalingSimulator)."""
    return ScalingSimulator(measured)


# The memory calculator (chapter 07)
CALCULATOR_WORLD_SIZES = [2**k for k in range(14)]  # 1 ... 8192
DESCRIPTION_PX = 150    # the controls' description column
# A dropdown shows only what fits its width and cuts the rest ("Adam / AdamW (m,"): size it from its longest
# option, 8 px a character (JupyterLab's 13 px font averages 6: measured 138 px for "bf16/fp16 + fp32 master")
# and 40 px for the arrow and padding.
CHAR_PX, ARROW_PX = 8, 40


class MemoryCalculator:
    """Controls for model_states; shows every stage side by side, the chosen one described in words."""

    def __init__(self, num_params=7.5e9, world_size=64, stage=3, optimizer="adam", precision="mixed",
                 offload=False, device_gb=80):
        import ipywidgets as w

        style, wide = {"description_width": f"{DESCRIPTION_PX}px"}, w.Layout(width="560px")
        # step=None: any value, so the browser keeps the given one (the default step of 0.1 in the exponent
        # snaps 7.5e9 to 7.94e9, 6 % off).
        self.params = w.FloatLogSlider(value=num_params, base=10, min=6, max=12, step=None, description="parameters",
                                       readout_format=".3g", style=style, layout=wide)
        self.world = w.SelectionSlider(options=CALCULATOR_WORLD_SIZES, value=world_size, description="world size (GPUs)",
                                       style=style, layout=wide)
        self.stage = w.ToggleButtons(options=[(f"stage {s}", s) for s in range(4)], value=stage,
                                     description="ZeRO stage", style=style)
        # One width for both dropdowns, so they line up: room for the longest option of either.
        longest = max(map(len, [*OPTIMIZER_LABELS.values(), *PRECISION_LABELS.values()]))
        fits = w.Layout(width=f"{DESCRIPTION_PX + CHAR_PX * longest + ARROW_PX}px")
        self.optimizer = w.Dropdown(options=[(v, k) for k, v in OPTIMIZER_LABELS.items()], value=optimizer,
                                    description="optimizer", style=style, layout=fits)
        self.precision = w.Dropdown(options=[(v, k) for k, v in PRECISION_LABELS.items()], value=precision,
                                    description="precision", style=style, layout=fits)
        # wide: the default 300 px, less the 150 px indent, cuts the label to "offload to CPU (..."
        self.offload = w.Checkbox(value=offload, description="offload to CPU (ZeRO-Offload)", style=style,
                                  layout=wide)
        self.device_gb = w.BoundedFloatText(value=device_gb, min=1, max=10_000, description="GB per device",
                                            style=style)
        self.summary = w.HTML()
        self.out = w.Output()
        self.controls = [self.params, self.world, self.stage, self.optimizer, self.precision, self.offload,
                         self.device_gb]
        self.widget = w.VBox([*self.controls, self.summary, self.out])
        self.rows, self.figure = [], None
        for control in self.controls:
            control.observe(lambda _: self.update(), names="value")
        self.update()

    def settings(self) -> dict:
        return {"optimizer": self.optimizer.value, "precision": self.precision.value, "offload": self.offload.value}

    def update(self) -> None:
        psi, n = self.params.value, self.world.value
        self.rows = stages_table(psi, n, **self.settings())
        per = self.rows[0]["bytes_per_param"]
        self.figure = stages_plot(
            self.rows, device_bytes=self.device_gb.value * 1e9,
            title=(f"Model states per device: {psi:.3g} parameters on {n} GPUs,\n"
                   f"{OPTIMIZER_LABELS[self.optimizer.value]}, {PRECISION_LABELS[self.precision.value]} "
                   f"({per['param_bytes']} + {per['grad_bytes']} + {per['optimizer_bytes']} bytes/parameter)"))
        self.summary.value = self.describe()
        show_in(self.out, [self.figure])

    def describe(self) -> str:
        """The chosen stage in one paragraph (HTML): memory, whether it fits, the largest model, communication."""
        row = self.rows[self.stage.value]
        device = self.device_gb.value * 1e9
        fits = "fits" if row["total"] <= device else "does <b>not</b> fit"
        biggest = largest_model(device, self.world.value, self.stage.value,
                                **{**self.settings(), "offload": self.offload.value and self.stage.value >= 1})
        offload = f"; {gb(row['cpu'])} per rank in CPU memory" if row["cpu"] else ""
        if self.offload.value and self.stage.value == 0:
            offload = " (offload needs stage ≥ 1: ignored)"
        return (f"<b>{STAGE_NAMES[self.stage.value]}</b>: {gb(row['total'])} per device "
                f"({', '.join(f'{p} {gb(row[p])}' for p in PARTS)}){offload} — {fits} in {gb(device)} before "
                f"activations. Largest model whose states fit: <b>{biggest:.3g}</b> parameters. "
                f"Communication per step: {gb(row['comm'])} per rank"
                f"{' (1.5× data parallel)' if self.stage.value == 3 else ' (as data parallel)'}.")

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


def memory_calculator(**kwargs) -> MemoryCalculator:
    """The chapter 07 memory calculator (keyword arguments: starting values, see MemoryCalculator)."""
    return MemoryCalculator(**kwargs)


# --- chapter 12: the parallelism planner (modelled) -------------------------------------------------------------

PLANNER_GPUS = [2 ** k for k in range(3, 16)]  # 8 to 32,768
PLANNER_DEGREES = [2 ** k for k in range(0, 11)]


class ParallelismPlanner:
    """Model, GPU count, dp/tp/pp/cp/ep and the pipeline schedule: memory per GPU against the device's, and the
    step-time estimate, all modelled by models.planner.plan_parallelism. Moving the GPU count moves dp with it
    (tp, pp and cp stay); a layout that does not divide what it splits is refused in the summary, with the
    planner's message. The global batch (sequences a step) stays as set whatever the layout."""

    def __init__(self, model="llama3-70b", gpus=1024, dp=32, tp=8, pp=4, cp=1, ep=1, seq=8192, global_batch=512,
                 recompute="selective", system="h100-sxm", schedule="1f1b", virtual_stages=1, zero=1, device_gib=80):
        import ipywidgets as w

        style = {"description_width": f"{DESCRIPTION_PX}px"}
        self.model = w.Dropdown(options=list(planner.SHAPES), value=model, description="model", style=style)
        self.gpus = w.SelectionSlider(options=PLANNER_GPUS, value=gpus, description="GPUs", style=style,
                                      layout=w.Layout(width="560px"))
        # Short labels in a row of their own, the first dropdown lined up with the controls above and below
        self.degrees = {name: w.Dropdown(options=PLANNER_DEGREES, value=value, description=name,
                                         style={"description_width": "30px"}, layout=w.Layout(width="120px"))
                        for name, value in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep))}
        self.seq = w.Dropdown(options=[2 ** k for k in range(9, 18)], value=seq, description="sequence (tokens)",
                              style=style)
        self.batch = w.BoundedIntText(value=global_batch, min=1, max=10 ** 7, description="global batch (seqs)",
                                      style=style)
        self.recompute = w.ToggleButtons(options=list(planner.RECOMPUTE), value=recompute, description="recompute",
                                         style=style)
        self.schedule = w.ToggleButtons(options=list(planner.SCHEDULES), value=schedule, description="schedule",
                                        style=style)
        self.virtual = w.Dropdown(options=[1, 2, 3, 4, 6, 8], value=virtual_stages, description="chunks a rank",
                                  style=style)
        self.zero = w.Dropdown(options=[0, 1, 2, 3], value=zero, description="ZeRO stage", style=style)
        self.system = w.Dropdown(options=sorted(costs.SYSTEMS), value=system, description="system", style=style)
        self.device_gib = w.BoundedFloatText(value=device_gib, min=1, max=10_000, description="GiB per device",
                                             style=style)
        self.summary = w.HTML()
        self.out = w.Output()
        self.controls = [self.model, *self.degrees.values(), self.seq, self.batch, self.recompute, self.schedule,
                         self.virtual, self.zero, self.system, self.device_gib]
        row = w.HBox(list(self.degrees.values()), layout=w.Layout(margin=f"0 0 0 {DESCRIPTION_PX - 30}px"))
        self.widget = w.VBox([self.model, self.gpus, row, self.seq, self.batch, self.recompute, self.schedule,
                              self.virtual, self.zero, self.system, self.device_gib, self.summary, self.out])
        self.plan, self.error, self.figure = None, None, None
        self.gpus.observe(self._gpus_moved, names="value")
        for control in self.controls:
            control.observe(lambda _: self.update(), names="value")
        self.update()

    def _gpus_moved(self, change) -> None:
        """dp follows the GPU count when the other degrees divide it (else the summary says why not)."""
        other = self.degrees["tp"].value * self.degrees["pp"].value * self.degrees["cp"].value
        dp = change["new"] // other
        if change["new"] % other == 0 and dp in PLANNER_DEGREES and dp != self.degrees["dp"].value:
            self.degrees["dp"].value = dp  # its observer redraws
        else:
            self.update()

    def update(self) -> None:
        schedule = self.schedule.value
        try:
            self.plan = planner.plan_parallelism(
                self.model.value, gpus=self.gpus.value, **{k: c.value for k, c in self.degrees.items()},
                seq=self.seq.value, global_batch=self.batch.value, recompute=self.recompute.value,
                schedule=schedule, virtual_stages=self.virtual.value if schedule == "interleaved" else 1,
                zero=self.zero.value, system=self.system.value, device_bytes=self.device_gib.value * 2 ** 30)
            self.error = None
        except ValueError as exc:
            self.plan, self.error, self.figure = None, str(exc), None
            self.summary.value = f"<b>Not a plan:</b> {html.escape(self.error)}"
            show_in(self.out, [])
            return
        self.figure = plan_plot(self.plan)
        self.summary.value = self.describe()
        show_in(self.out, [self.figure])

    def describe(self) -> str:
        p = self.plan
        fits = "fits in" if p["fits"] else "does <b>not</b> fit in"
        warn = "".join(f"<br>⚠ {html.escape(text)}" for text in p["warnings"])
        gib = 2 ** 30
        return (f"<b>Modelled</b> (not run): {p['params'] / 1e9:.3g} billion parameters; peak "
                f"{p['peak_bytes'] / gib:.1f} GiB of tensors per GPU, {p['reserved_bytes'] / gib:.1f} GiB with the "
                f"CUDA context, NCCL and fragmentation — {fits} {p['device_bytes'] / gib:.0f} GiB. Step "
                f"{human_seconds(p['step_s'])} for {p['global_batch']:,} sequences in {p['micro_batches']} "
                f"micro-batch{'es' if p['micro_batches'] > 1 else ''}; MFU {human_percent(p['mfu'])}, HFU "
                f"{human_percent(p['hfu'])} (an estimate: matmuls at a measured sustained rate, every term in "
                f"the chart).{warn}")

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


def parallelism_planner(**kwargs) -> ParallelismPlanner:
    """Chapter 12's planner (keyword arguments: starting values, see ParallelismPlanner)."""
    return ParallelismPlanner(**kwargs)
