"""The profile's reports: JSON (machines), Markdown (a PR comment), HTML (a person).

The HTML page is self-contained: its plots are matplotlib PNGs embedded as base64, so it can be
mailed, attached to a CI run or logged to MLflow as one file. Everything is written atomically,
into the profile's run directory and to ``.trainguard/profile/latest.{json,md,html}``.
"""

from __future__ import annotations

import base64
import io
import json
import math
from pathlib import Path
from typing import Any

from trainguard._internal.atomic import write_or_fallback

__all__ = ["PACE_TABLE_HTML", "PACE_TABLE_MD", "PLOTS", "plot_goodput", "render_html", "render_markdown",
           "write_reports"]

#: plot name -> title, in page order
PLOTS = {
    "step_times": "Step-time distribution",
    "scaling": "Throughput and efficiency vs world size",
    "loss": "Loss curves of the profile runs and the checks",
    "cost": "Predicted cost and wall-clock vs GPUs",
    "goodput": "Goodput forecast vs world size and vs checkpoint interval",
    "headroom": "Peak memory per rank vs batch size (headroom search)",
}


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isinf(value) or math.isnan(value):
            return str(value)
        return f"{value:.{digits}g}"
    return str(value)


def _figure(width: float = 7.5, height: float = 3.4) -> Any:
    # the Agg canvas on a bare Figure: no pyplot, no global backend switch in the caller
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


#: margins in inches around a row of panels: left of the first, right of the last, between two,
#: and what a right-hand axis (twinx) adds beside its panel
_LEFT_IN, _RIGHT_IN, _GAP_IN, _TWIN_IN, _BOTTOM_IN, _TOP_IN = 0.8, 0.2, 0.9, 0.7, 0.6, 0.4


def _layout(fig: Any) -> None:
    """Fixed margins for a row of panels, in inches: a layout engine (constrained, tight) draws
    the figure once more to measure its text, a third of a report's plotting time."""
    width, height = fig.get_size_inches()
    panels = [ax for ax in fig.axes if ax.yaxis.get_label_position() == "left"]
    twins = {ax.get_subplotspec().colspan.start for ax in fig.axes
             if ax.yaxis.get_label_position() == "right" and ax.get_subplotspec() is not None}
    cols = max(len(panels), 1)
    right = _RIGHT_IN + (_TWIN_IN if cols - 1 in twins else 0.0)
    gap = _GAP_IN + (_TWIN_IN if twins - {cols - 1} else 0.0)
    panel = (width - _LEFT_IN - right - gap * (cols - 1)) / cols
    fig.subplots_adjust(left=_LEFT_IN / width, right=1 - right / width, bottom=_BOTTOM_IN / height,
                        top=1 - _TOP_IN / height, wspace=gap / panel if cols > 1 else 0.2)


def _png(fig: Any) -> bytes:
    _layout(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


def plot_step_times(data: dict[str, Any]) -> bytes | None:
    sizes = [s for s in data["sizes"] if s.get("step")]
    if not sizes:
        return None
    fig = _figure()
    ax = fig.subplots()
    all_values = [v for s in sizes for v in s["step"]["durations"].values()]
    lo, hi = min(all_values), max(all_values)
    bins = [lo + (hi - lo) * i / 30 for i in range(31)] if hi > lo else 10
    for i, s in enumerate(sizes):
        color = f"C{i}"
        values = list(s["step"]["durations"].values())
        ax.hist(values, bins=bins, alpha=0.45, color=color, label=f"{s['world_size']} rank(s)")
        for q, style in (("p50_s", "-"), ("p90_s", "--"), ("p99_s", ":")):
            ax.axvline(s["step"][q], color=color, linestyle=style, linewidth=1.2)
    ax.set_xlabel("step time (s); lines: p50 solid, p90 dashed, p99 dotted")
    ax.set_ylabel("steps")
    warm = data["settings"]["warmup_steps"]
    ax.set_title(f"Step times after {warm} warm-up step(s) ({data['device'].upper()})", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _png(fig)


def plot_scaling(data: dict[str, Any]) -> bytes | None:
    measured = {int(s["world_size"]): s["throughput_sps"] for s in data["sizes"] if s.get("throughput_sps")}
    if not measured:
        return None
    scaling = data["scaling"]
    fig = _figure(height=3.6)
    ax1, ax2 = fig.subplots(1, 2)
    base = min(measured)
    xs = sorted(measured)
    ax1.plot(xs, [measured[n] for n in xs], "o", color="C0", markersize=7, label="measured")
    preds = {int(k): v for k, v in scaling["predictions"].items() if v.get("fit_sps")}
    fit = scaling.get("fit") or {}
    if fit.get("chosen") and preds:
        inside = [n for n in sorted(preds) if min(xs) <= n <= max(xs)]
        label = f"{fit['chosen']} fit"
        ax1.plot(inside, [preds[n]["fit_sps"] for n in inside], "-", color="C1", label=label)
        for i, part in enumerate(([n for n in preds if n <= min(xs)], [n for n in preds if n >= max(xs)])):
            if len(part) > 1:
                part.sort()
                ax1.plot(part, [preds[n]["fit_sps"] for n in part], "--", color="C1",
                         label=f"{label} (extrapolated)" if i else None)
    ideal_x = sorted(set(xs) | set(preds))
    ax1.plot(ideal_x, [measured[base] * n / base for n in ideal_x], ":", color="grey", label="ideal (linear)")
    # the ideal line grows without bound: scale to what was measured and predicted
    top = max([*measured.values(), *(p["fit_sps"] for p in preds.values())])
    ax1.set_ylim(0, top * 1.35)
    ax1.set_xlabel("world size")
    ax1.set_ylabel(data.get("throughput_unit", "samples/s"))
    ax1.set_title(f"Throughput ({scaling['kind']} scaling)", fontsize=10)
    ax1.legend(fontsize=7)
    ax1.grid(alpha=0.3)
    table = {int(k): v for k, v in scaling["table"].items()}
    ax2.bar([str(n) for n in sorted(table)], [table[n]["efficiency"] * 100 for n in sorted(table)], color="C0")
    for i, n in enumerate(sorted(table)):
        ax2.text(i, table[n]["efficiency"] * 100 + 1, f"{table[n]['speedup']:.2f}x", ha="center", fontsize=8)
    target = (data.get("sizing") or {}).get("target") or {}
    if target.get("min_efficiency"):
        ax2.axhline(target["min_efficiency"] * 100, color="C3", linestyle="--", label="minimum")
        ax2.legend(fontsize=7)
    ax2.set_ylim(0, 115)
    ax2.set_xlabel("world size (measured)")
    ax2.set_ylabel("efficiency (%)")
    ax2.set_title("Scaling efficiency (bar label: speed-up)", fontsize=10)
    ax2.grid(alpha=0.3, axis="y")
    return _png(fig)


def plot_loss(data: dict[str, Any]) -> bytes | None:
    """The profile runs' loss curves, and beside them those of the checks that ran before the
    profile in the same session (``data["check_curves"]``)."""
    sizes = [s for s in data["sizes"] if s.get("loss")]
    checks = [c for c in data.get("check_curves") or [] if c.get("values")]
    if not sizes and not checks:
        return None
    fig = _figure(width=11.0 if checks else 7.5, height=3.2)
    axes = fig.subplots(1, 2) if sizes and checks else [fig.subplots()]
    if sizes:
        ax = axes[0]
        for i, s in enumerate(sizes):
            pts = sorted((int(k), v) for k, v in s["loss"].items())
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=f"C{i}", label=f"{s['world_size']} rank(s)")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (rank 0)")
        ax.set_title("Profile runs", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    if checks:
        ax = axes[-1]
        for i, c in enumerate(checks):
            pts = sorted((int(k), float(v)) for k, v in c["values"].items())
            failed = c.get("outcome") not in (None, "ok")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=f"C{i % 10}",
                    linestyle="--" if failed else "-", linewidth=1.1, alpha=0.85,
                    label=f"{c['label']} ({c['world_size']} rank{'s' if c['world_size'] != 1 else ''})"
                    + (f", {c['outcome']}" if failed else ""))
        ax.set_xlabel("step")
        ax.set_ylabel(checks[0].get("metric", "loss"))
        ax.set_title("Runs of the checks in this session", fontsize=10)
        ax.legend(fontsize=7, ncol=2)
        ax.grid(alpha=0.3)
    return _png(fig)


def plot_cost(data: dict[str, Any]) -> bytes | None:
    sizing = data.get("sizing")
    if not sizing or not sizing["candidates"]:
        return None
    cands = sizing["candidates"]
    target = sizing["target"]
    fig = _figure(height=3.4)
    ax = fig.subplots()
    xs = [c["gpus"] for c in cands]
    priced = target["price_per_gpu_hour"] > 0
    ys = [c["cost"] if priced else c["gpu_hours"] for c in cands]
    colors = ["C2" if c["feasible"] else "C3" for c in cands]
    hatches = ["//" if c["extrapolated"] else "" for c in cands]
    for x, y, col, h in zip(xs, ys, colors, hatches):
        ax.bar(x, y, color=col, alpha=0.7, hatch=h, edgecolor="black", linewidth=0.4)
    ax.set_xlabel("GPUs (green: feasible, red: not; hatched: extrapolated)")
    ax.set_ylabel("cost" if priced else "GPU-hours")
    ax2 = ax.twinx()
    ax2.plot(xs, [c["hours_with_failures"] for c in cands], "o-", color="C0", label="wall-clock (h)")
    if target.get("deadline_hours"):
        ax2.axhline(target["deadline_hours"], color="C0", linestyle="--", label="deadline")
    ax2.set_ylabel("wall-clock (h)")
    ax2.legend(fontsize=7, loc="upper center")
    rec = sizing.get("recommended")
    unit = "GPU(s)" if data.get("device") == "gpu" else "rank(s), measured on CPU"
    title = f"Predicted full run; recommended: {rec} {unit}" if rec else "Predicted full run; no size meets every constraint"
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    return _png(fig)


def plot_goodput(data: dict[str, Any]) -> bytes | None:
    """Goodput (effective training time ratio) per world size, and vs the checkpoint interval at
    the recommended size with the chosen interval, Young/Daly's and the lost-work cap."""
    sizing = data.get("sizing")
    cands = [c for c in (sizing or {}).get("candidates") or [] if c.get("goodput") is not None]
    if not sizing or not cands:
        return None
    fig = _figure(width=10.0, height=3.4)
    ax1, ax2 = fig.subplots(1, 2)
    xs = [c["gpus"] for c in cands]
    ax1.plot(xs, [c["goodput"] * 100 for c in cands], "o-", color="C0", label="goodput (%)")
    limit = ((data.get("gate_thresholds") or {}).get("min_goodput"))
    if limit:
        ax1.axhline(limit * 100, color="C3", linestyle="--", label="gate.thresholds.min_goodput")
    low = min(c["goodput"] for c in cands) * 100
    ax1.set_ylim(max(0.0, min(low, (limit or 1) * 100) - 2), 100.5)
    ax1.set_xlabel("GPUs")
    ax1.set_ylabel("goodput (% of wall-clock making progress)")
    ax1b = ax1.twinx()
    ax1b.bar(xs, [c["expected_failures"] for c in cands], color="C1", alpha=0.3, label="expected failures")
    ax1b.set_ylabel("expected failures")
    ax1.set_title("Goodput at each size's best interval", fontsize=10)
    ax1.legend(fontsize=7, loc="lower left")
    ax1.grid(alpha=0.3)
    curve = sizing.get("goodput_curve")
    if curve and curve.get("points"):
        pts = curve["points"]
        ax2.plot([p[0] / 60 for p in pts], [p[1] * 100 for p in pts], "-", color="C0")
        ax2.axvline(curve["chosen_s"] / 60, color="C2", label=f"chosen {curve['chosen_s'] / 60:.3g} min")
        ax2.axvline(curve["cap_s"] / 60, color="C3", linestyle="--", label="max_lost_minutes cap")
        shown = next((c for c in cands if c["gpus"] == curve["gpus"]), None)
        if shown is not None and shown.get("young_daly_s"):
            ax2.axvline(shown["young_daly_s"] / 60, color="grey", linestyle=":", label="Young/Daly")
        ax2.set_xscale("log")
        top = max(p[1] for p in pts) * 100
        ax2.set_ylim(max(0.0, top - 10), top + 0.5)
        ax2.set_title(f"Goodput vs checkpoint interval at {curve['gpus']} GPU(s)", fontsize=10)
        ax2.legend(fontsize=7)
    ax2.set_xlabel("checkpoint interval (min, log)")
    ax2.set_ylabel("goodput (%)")
    ax2.grid(alpha=0.3)
    return _png(fig)


def plot_headroom(data: dict[str, Any]) -> bytes | None:
    """Peak memory of every probe vs its batch (passes, OOMs, other failures), the fitted line,
    the budget and the budget less the margin."""
    search = data.get("headroom")
    if not search or not search.get("probes"):
        return None
    fig = _figure(height=3.4)
    ax = fig.subplots()
    budget = search["budget_mb"]
    marks = {"pass": ("o", "C0", "passed"), "oom": ("x", "C3", "out of memory (at the budget)"),
             "error": ("s", "C7", "other failure")}
    for outcome, (marker, color, label) in marks.items():
        pts = [p for p in search["probes"] if p["outcome"] == outcome]
        if pts:
            # an OOM probe reached the budget by definition; its sampled peak may be lower
            ys = [budget if outcome == "oom" or p["peak_mb"] is None else p["peak_mb"] for p in pts]
            ax.plot([p["batch_size"] for p in pts], ys, marker, color=color, markersize=8, label=label)
    batches = [p["batch_size"] for p in search["probes"]]
    fit = search.get("fit")
    if fit:
        xs = [0, max(batches) * 1.05]
        ax.plot(xs, [fit["fixed_mb"] + fit["per_sample_mb"] * x for x in xs], "-", color="C1",
                linewidth=1, label=f"fit: {fit['fixed_mb']:.0f} MB + {fit['per_sample_mb']:.3g} MB/sample")
    ax.axhline(budget, color="C3", linestyle="--", label=f"budget {budget:.0f} MB")
    ax.axhline(budget * (1 - search["margin"]), color="C2", linestyle=":",
               label=f"budget less {search['margin']:.0%} margin")
    if search.get("safe_batch"):
        ax.axvline(search["safe_batch"], color="C2", linewidth=1, alpha=0.6)
        ax.text(search["safe_batch"], budget * 0.04, f" safe {search['safe_batch']}", color="C2", fontsize=8)
    ax.set_ylim(0, budget * 1.15)
    ax.set_xlabel("batch size ({batch_size})")
    ax.set_ylabel(f"peak MB per rank ({search['enforcement']})")
    ax.set_title(f"Headroom search on {search['device'].upper()}: {search['stopped'].replace('_', ' ')}", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    return _png(fig)


_PLOTTERS = {"step_times": plot_step_times, "scaling": plot_scaling, "loss": plot_loss, "cost": plot_cost,
             "goodput": plot_goodput, "headroom": plot_headroom}


def render_plots(data: dict[str, Any]) -> dict[str, bytes]:
    """Every plot the data allows, as PNG bytes."""
    out: dict[str, bytes] = {}
    for name, plotter in _PLOTTERS.items():
        png = plotter(data)
        if png is not None:
            out[name] = png
    return out


def _columns(data: dict[str, Any]) -> list[tuple[str, str]]:
    unit = data.get("throughput_unit", "samples/s")
    return [(key, unit if key == "throughput" else title) for key, title in _COLUMNS]


def _rows(data: dict[str, Any]) -> list[dict[str, str]]:
    table = data["scaling"]["table"]
    rows = []
    for s in data["sizes"]:
        step = s.get("step") or {}
        eff = table.get(str(s["world_size"]), {})
        ckpt = s.get("checkpoint") or {}
        rows.append(
            {
                "ranks": str(s["world_size"]) + (" (oversubscribed)" if s.get("oversubscribed") else ""),
                "outcome": s["outcome"],
                "startup": _fmt(s.get("startup_s")),
                "p50": _fmt(step.get("p50_s")),
                "p90": _fmt(step.get("p90_s")),
                "p99": _fmt(step.get("p99_s")),
                "throughput": _fmt(s.get("throughput_sps"), 4),
                "speedup": f"{eff['speedup']:.2f}x" if eff else "-",
                "efficiency": f"{eff['efficiency']:.0%}" if eff else "-",
                "rss": _fmt(max(s["peak_rss_mb"].values()) if s.get("peak_rss_mb") else None, 4),
                "gpu_mem": _fmt(max(s["peak_gpu_mb"].values()) if s.get("peak_gpu_mb") else None, 4),
                "cpu": ", ".join(f"{v:.0f}%" for v in s.get("cpu_util_pct", {}).values()) or "-",
                "gpu_util": _fmt(s.get("gpu_util_pct")),
                "ckpt": _fmt(ckpt.get("cost_s")),
                "data_wait": f"{s['data_wait_share']:.0%}" if s.get("data_wait_share") is not None else "-",
            }
        )
    return rows


_COLUMNS = [
    ("ranks", "ranks"), ("outcome", "outcome"), ("startup", "startup s"), ("p50", "p50 step s"),
    ("p90", "p90 s"), ("p99", "p99 s"), ("throughput", "samples/s"), ("speedup", "speed-up"),
    ("efficiency", "efficiency"), ("rss", "peak RSS MB/rank"), ("gpu_mem", "peak GPU MB/rank"),
    ("cpu", "CPU % per rank"), ("gpu_util", "GPU util %"), ("ckpt", "checkpoint s"),
    ("data_wait", "data wait"),
]


def failure_rows(sizing: dict[str, Any] | None) -> list[tuple[str, str, str]]:
    """(input, value, source) of the goodput forecast: checkpoint save, load, restart, lost steps
    and the MTBF, each measured or default (the reports' inputs table)."""
    inputs = (sizing or {}).get("failure_inputs")
    if not sizing or not inputs:
        return []
    target = sizing["target"]
    saves = sorted({c["checkpoint_cost_s"] for c in sizing["candidates"] if c.get("checkpoint_cost_s") is not None})
    load = ("included in the restart" if inputs.get("load_in_restart") else
            f"{inputs['load_s']:.3g} s" if inputs.get("load_s") is not None else "= the save")
    lost = inputs.get("lost_steps")
    cadence = next((c["job_checkpoint_every_steps"] for c in sizing["candidates"]
                    if c.get("job_checkpoint_every_steps")), None)
    lost_text = "half an interval" + (f"; the job saves every {cadence} steps (half: {cadence / 2:g})"
                                      if cadence else "")
    return [
        ("checkpoint save", ", ".join(f"{v:.3g} s" for v in saves) or "0 s",
         "measured by the profile (nearest measured size)" if saves else "not measured: 0 assumed"),
        ("checkpoint load", load, inputs["load_source"]),
        ("restart (fault -> first new step)", f"{inputs['restart_s']:.4g} s", inputs["restart_source"]),
        ("lost work per failure", lost_text + (f"; drills lost {lost:g} step(s)" if lost is not None else ""),
         inputs["lost_source"]),
        ("MTBF", f"{target['mtbf_hours']:g} h per GPU / GPUs" + (f", per count {target['mtbf_hours_by_gpus']}"
                                                              if target.get("mtbf_hours_by_gpus") else ""),
         "target.mtbf_hours"),
    ]


def _context(data: dict[str, Any]) -> dict[str, Any]:
    fit = data["scaling"].get("fit") or {}
    models = [fit[k] for k in ("amdahl", "usl") if fit.get(k)]
    return {
        "d": data,
        "rows": _rows(data),
        "columns": _columns(data),
        "models": models,
        "fmt": _fmt,
        "sizing": data.get("sizing"),
        "failure_rows": failure_rows(data.get("sizing")),
        "hr": data.get("headroom"),
        "compare": {"baseline": None, "results": [], **(data.get("compare") or {})},
    }


#: one run's per-rank pace table (``p``: a :class:`~trainguard.launch.pace.PaceReport`'s
#: ``to_dict``), in Markdown and in HTML; the gate's report uses them too
PACE_TABLE_MD = """| rank | steps | busy (median) | ratio to the busiest other | straggler |
|---|---|---|---|---|
{% for r in p.ranks %}| {{ r.rank }} | {{ r.steps }} | {{ "%.2f" % r.busy }} | {{ "%.2f" % r.ratio }} | {{ "yes, named at step %s" % r.named_at_step if r.straggler else "no" }} |
{% endfor %}"""
PACE_TABLE_HTML = """<table><tr><th>rank</th><th>steps</th><th>busy (median)</th><th>ratio to the busiest other</th><th>straggler</th></tr>\
{% for r in p.ranks %}<tr><td>{{ r.rank }}</td><td>{{ r.steps }}</td><td>{{ "%.2f" % r.busy }}</td><td>{{ "%.2f" % r.ratio }}</td>\
<td>{{ "yes, named at step %s" % r.named_at_step if r.straggler else "no" }}</td></tr>{% endfor %}</table>"""

_MARKDOWN = """\
## trainguard profile: {{ d.job }}

Measured on {{ d.measured_on }}. Scaling: **{{ d.scaling.phrase or "not measured" }}**.

| {% for key, title in columns %}{{ title }} | {% endfor %}
|{% for key, title in columns %}---|{% endfor %}
{% for r in rows %}| {% for key, title in columns %}{{ r[key] }} | {% endfor %}
{% endfor %}
{% for s in d.sizes if s.get("pace") and s.pace.ranks %}{% set p = s.pace %}
**Ranks at {{ s.world_size }}** ({{ p.summary }}; steps timed from rank {{ s.get("timed_rank", 0) }}'s lines):

""" + PACE_TABLE_MD + """{% endfor %}
{% if models %}
**Scaling fit** (relative throughput C(N) = N / (1 + sigma (N-1) + kappa N (N-1))): {{ d.scaling.fit.why }}.
{% for m in models %}- {{ m.name }}{% if m.name == d.scaling.fit.chosen %} (chosen){% endif %}: sigma {{ fmt(m.sigma, 4) }}, kappa {{ fmt(m.kappa, 4) }}, rms residual {{ fmt(m.rms_residual, 3) }}{% if m.unvalidated %} (no spare points: unvalidated){% endif %}
{% endfor %}
{% endif %}
{% if sizing %}
### Sizing
**{{ "Recommended: " if sizing.recommended else "" }}{{ sizing.recommendation }}**

| GPUs | source | efficiency | wall-clock h | GPU-hours | cost | checkpoint every | memory headroom MB | feasible |
|---|---|---|---|---|---|---|---|---|
{% for c in sizing.candidates %}| {{ c.gpus }} | {{ "extrapolated" if c.extrapolated else "measured" }} | {{ "%.0f%%"|format(c.efficiency * 100) }} | {{ fmt(c.hours_with_failures) }} | {{ fmt(c.gpu_hours) }} | {{ "%.2f"|format(c.cost) }} | {% if c.checkpoint_every_s %}{{ "%.1f"|format(c.checkpoint_every_s / 60) }} min ({{ c.checkpoint_every_steps }} steps){% else %}-{% endif %} | {{ fmt(c.memory_headroom_mb, 5) }} | {{ "yes" if c.feasible else c.why_not|join("; ") }} |
{% endfor %}
{% if sizing.get("failure_inputs") %}
**Goodput forecast** (time making new progress / wall-clock, checkpoint interval chosen to maximise it):

| GPUs | goodput | expected failures | wall-clock h with failures | GPU-hours wasted | checkpoint every | goodput at the job's own cadence |
|---|---|---|---|---|---|---|
{% for c in sizing.candidates if c.goodput is not none %}| {{ c.gpus }} | {{ "%.2f%%"|format(c.goodput * 100) }} | {{ fmt(c.expected_failures, 3) }} | {{ fmt(c.hours_with_failures) }} | {{ fmt(c.wasted_gpu_hours, 3) }} | {{ fmt(c.checkpoint_every_s / 60) }} min | {% if c.get("goodput_at_job_cadence") is not none %}{{ "%.2f%%"|format(c.goodput_at_job_cadence * 100) }} (every {{ c.job_checkpoint_every_steps }} steps){% else %}-{% endif %} |
{% endfor %}
Inputs: {% for name, value, source in failure_rows %}{{ name }} {{ value }} ({{ source }}){% if not loop.last %}; {% endif %}{% endfor %}.
{% endif %}
{% if sizing.get("timeouts") %}
**Recommended timeouts** at {{ sizing.timeouts[0].gpus }} {{ "GPU(s)" if d.device == "gpu" else "rank(s)" }}:
{% for t in sizing.timeouts %}- `{{ t.setting }}`: {{ t.value }} -- {{ t.reason }}
{% endfor %}{% endif %}
{% if sizing.get("batch_headroom") %}Memory headroom per rank: {{ sizing.batch_headroom.summary }}.
{% endif %}
{% if sizing.limits %}What limits scaling:
{% for l in sizing.limits %}- {{ l }}
{% endfor %}{% endif %}
{% endif %}
{% if hr %}
### Memory headroom
**{{ hr.summary }}** ({{ hr.reason }}). Budget {{ fmt(hr.budget_mb, 5) }} MB per rank ({{ hr.budget_source }}), enforced by {{ hr.enforcement }}{% if hr.fallback %} (fallback: {{ hr.fallback }}){% endif %}; {{ hr.world_size }} rank(s) per probe. Safe batch: {{ hr.safe_rule }}.{% if hr.fit %} Fit: {{ fmt(hr.fit.fixed_mb, 4) }} MB + {{ fmt(hr.fit.per_sample_mb, 4) }} MB/sample (rms {{ fmt(hr.fit.rms_mb, 3) }} MB).{% endif %}

| batch | outcome | peak MB/rank | peak RSS MB | peak GPU MB | seconds | how it ended |
|---|---|---|---|---|---|---|
{% for p in hr.probes %}| {{ p.batch_size }} | {{ p.outcome }} | {{ fmt(p.peak_mb, 5) }} | {{ fmt(p.peak_rss_mb, 5) }} | {{ fmt(p.peak_gpu_mb, 5) }} | {{ fmt(p.duration_s) }} | {{ p.detail }} |
{% endfor %}
{% endif %}
{% if compare.results %}
### Compared with {{ compare.baseline }}
{% for r in compare.results %}- {{ r.text }}
{% endfor %}
{% endif %}
{% for n in d.notes %}- {{ n }}
{% endfor %}
"""

_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>trainguard profile: {{ d.job }}</title>
<style>
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1250px; color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.8em; margin: 0.6em 0; }
th, td { border: 1px solid #ccc; padding: 3px 7px; text-align: right; }
th { background: #f3f3f3; } td:first-child, th:first-child { text-align: left; }
.phrase { font-size: 1.15em; background: #eef6ee; padding: 0.6em 0.9em; border-left: 4px solid #3a3; }
.warn { background: #fff6e0; padding: 0.5em 0.9em; border-left: 4px solid #e90; }
.bad { color: #b00; font-weight: bold; } .ok { color: #070; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.4em 0; }
.meta { color: #666; font-size: 0.85em; } .wide { overflow-x: auto; }
</style></head><body>
<h1>trainguard profile: {{ d.job }}</h1>
<p class="meta">{{ d.created_at }} &middot; trainguard {{ d.trainguard_version }} &middot; commit {{ (d.commit.id or "none")[:12] }}{% if d.commit.dirty %} (dirty){% endif %} &middot; {{ d.machine.id }} &middot; {{ d.job_file }}</p>
{% if d.device == "cpu" %}<p class="warn">Measured on {{ d.measured_on }}.</p>{% else %}<p class="meta">Measured on {{ d.measured_on }}.</p>{% endif %}
<p class="phrase">{{ d.scaling.phrase or "Scaling not measured" }}</p>
<h2>Per world size</h2>
<div class="wide"><table><tr>{% for key, title in columns %}<th>{{ title }}</th>{% endfor %}</tr>
{% for r in rows %}<tr>{% for key, title in columns %}<td>{{ r[key] }}</td>{% endfor %}</tr>
{% endfor %}</table></div>
<p class="meta">{{ d.settings.steps }} steps per run, the first {{ d.settings.warmup_steps }} excluded as warm-up; {{ d.scaling.kind }} scaling.</p>
{% for s in d.sizes if s.get("pace") and s.pace.ranks %}{% set p = s.pace %}<h2>Ranks at {{ s.world_size }}</h2>\
<p class="meta">{{ p.summary }}; steps timed from rank {{ s.get("timed_rank", 0) }}'s lines.</p>""" + PACE_TABLE_HTML + """{% endfor %}
{% if images.get("step_times") %}<h2>{{ titles.step_times }}</h2><img alt="{{ titles.step_times }}" src="data:image/png;base64,{{ images.step_times }}">{% endif %}
{% if images.get("scaling") %}<h2>{{ titles.scaling }}</h2><img alt="{{ titles.scaling }}" src="data:image/png;base64,{{ images.scaling }}">{% endif %}
{% if models %}<h2>Scaling model</h2>
<p>Relative throughput C(N) = N / (1 + &sigma;(N&minus;1) + &kappa;N(N&minus;1)); Amdahl is &kappa; = 0. {{ d.scaling.fit.why }}.</p>
<table><tr><th>model</th><th>&sigma;</th><th>&kappa;</th><th>rms residual</th><th>residuals by size</th><th>note</th></tr>
{% for m in models %}<tr><td>{{ m.name }}{% if m.name == d.scaling.fit.chosen %} (chosen){% endif %}</td><td>{{ fmt(m.sigma, 4) }}</td><td>{{ fmt(m.kappa, 4) }}</td><td>{{ fmt(m.rms_residual, 3) }}</td><td>{% for k, v in m.residuals.items() %}N={{ k }}: {{ "%+.4f"|format(v) }} {% endfor %}</td><td>{% if m.unvalidated %}no spare points: unvalidated {% endif %}{% if m.peak_ranks %}peak near {{ "%.1f"|format(m.peak_ranks) }}x base{% endif %}</td></tr>
{% endfor %}</table>{% endif %}
{% if sizing %}<h2>Sizing the full run</h2>
<p class="{{ 'ok' if sizing.recommended else 'bad' }}">{{ "Recommended: " if sizing.recommended else "" }}{{ sizing.recommendation }}</p>
<p class="meta">Target: {% for k, v in sizing.target.items() if v not in (None, {}, []) %}{{ k }} = {{ v }}{% if not loop.last %}, {% endif %}{% endfor %}. Memory budget per rank: {{ fmt(sizing.memory_budget_mb, 5) }} MB ({{ sizing.memory_budget_source }}).</p>
{% if sizing.get("batch_headroom") %}<p>Memory headroom per rank: {{ sizing.batch_headroom.summary }}.</p>{% endif %}
<table><tr><th>GPUs</th><th>source</th><th>{{ d.get("throughput_unit", "samples/s") }}</th><th>efficiency</th><th>steps</th><th>wall-clock h</th><th>expected failures</th><th>GPU-hours</th><th>cost</th><th>checkpoint every</th><th>memory headroom MB</th><th>feasible</th></tr>
{% for c in sizing.candidates %}<tr{% if c.gpus == sizing.recommended %} style="background:#eef6ee;font-weight:bold"{% endif %}><td>{{ c.gpus }}</td><td>{{ "extrapolated" if c.extrapolated else "measured" }}</td><td>{{ fmt(c.throughput_sps, 4) }}</td><td>{{ "%.0f%%"|format(c.efficiency * 100) }}</td><td>{{ c.steps }}</td><td>{{ fmt(c.hours_with_failures) }}</td><td>{{ fmt(c.expected_failures, 2) }}</td><td>{{ fmt(c.gpu_hours) }}</td><td>{{ "%.2f"|format(c.cost) }}</td><td>{% if c.checkpoint_every_s %}{{ "%.1f"|format(c.checkpoint_every_s / 60) }} min / {{ c.checkpoint_every_steps }} steps{% else %}-{% endif %}</td><td>{{ fmt(c.memory_headroom_mb, 5) }}</td><td>{{ "yes" if c.feasible else c.why_not|join("; ") }}</td></tr>
{% endfor %}</table>
{% if sizing.candidates %}<p class="meta">Checkpoint interval: {{ sizing.candidates[0].checkpoint_rule }} (MTBF of the job = per-GPU MTBF / GPUs unless configured per count).</p>{% endif %}
{% if sizing.limits %}<h2>What limits scaling</h2><ul>{% for l in sizing.limits %}<li>{{ l }}</li>{% endfor %}</ul>{% endif %}
{% if images.get("cost") %}<img alt="{{ titles.cost }}" src="data:image/png;base64,{{ images.cost }}">{% endif %}
{% if sizing.get("failure_inputs") %}<h2>Goodput forecast</h2>
<p>Goodput = time making new progress / wall-clock (Meta's ETTR), at each size's checkpoint interval that maximises it (capped by max_lost_minutes).</p>
<table><tr><th>GPUs</th><th>goodput</th><th>expected failures</th><th>wall-clock h with failures</th><th>GPU-hours wasted</th><th>checkpoint every</th><th>Young/Daly</th><th>goodput at the job's own cadence</th></tr>
{% for c in sizing.candidates if c.goodput is not none %}<tr><td>{{ c.gpus }}</td><td>{{ "%.2f%%"|format(c.goodput * 100) }}</td><td>{{ fmt(c.expected_failures, 3) }}</td><td>{{ fmt(c.hours_with_failures) }}</td><td>{{ fmt(c.wasted_gpu_hours, 3) }}</td><td>{{ fmt(c.checkpoint_every_s / 60) }} min</td><td>{{ fmt(c.young_daly_s / 60 if c.young_daly_s else None) }} min</td><td>{% if c.get("goodput_at_job_cadence") is not none %}{{ "%.2f%%"|format(c.goodput_at_job_cadence * 100) }} (every {{ c.job_checkpoint_every_steps }} steps){% else %}-{% endif %}</td></tr>
{% endfor %}</table>
<table><tr><th>input</th><th>value</th><th>source</th></tr>{% for name, value, source in failure_rows %}<tr><td>{{ name }}</td><td>{{ value }}</td><td>{{ source }}</td></tr>{% endfor %}</table>
{% if images.get("goodput") %}<img alt="{{ titles.goodput }}" src="data:image/png;base64,{{ images.goodput }}">{% endif %}
{% endif %}
{% if sizing.get("timeouts") %}<h2>Recommended timeouts at {{ sizing.timeouts[0].gpus }} {{ "GPU(s)" if d.device == "gpu" else "rank(s)" }}</h2><table><tr><th>setting</th><th>value</th><th>reason</th></tr>
{% for t in sizing.timeouts %}<tr><td>{{ t.setting }}</td><td>{{ t.value }}</td><td style="text-align:left">{{ t.reason }}</td></tr>{% endfor %}</table>{% endif %}
{% endif %}
{% if hr %}<h2>Memory headroom</h2>
<p class="{{ 'bad' if hr.failed else 'ok' }}">{{ hr.summary }}</p>
<p class="meta">{{ hr.reason }}. Budget {{ fmt(hr.budget_mb, 5) }} MB per rank ({{ hr.budget_source }}), enforced by {{ hr.enforcement }}{% if hr.fallback %} &mdash; fallback: {{ hr.fallback }}{% endif %}; {{ hr.world_size }} rank(s) per probe, {{ hr.probes|length }} probe(s) in {{ fmt(hr.duration_s) }} s. Safe batch: {{ hr.safe_rule }}.{% if hr.fit %} Fit: {{ fmt(hr.fit.fixed_mb, 4) }} MB + {{ fmt(hr.fit.per_sample_mb, 4) }} MB/sample (rms {{ fmt(hr.fit.rms_mb, 3) }} MB).{% endif %}{% if hr.headroom_mb is not none %} At the profile's batch {{ hr.profile_batch }}: peak {{ fmt(hr.peak_at_profile_batch_mb, 5) }} MB ({{ hr.peak_source }}), headroom {{ fmt(hr.headroom_mb, 5) }} MB per rank.{% endif %}</p>
<table><tr><th>batch</th><th>outcome</th><th>peak MB/rank</th><th>peak RSS MB</th><th>peak GPU MB</th><th>seconds</th><th>how it ended</th></tr>
{% for p in hr.probes %}<tr><td>{{ p.batch_size }}</td><td class="{{ '' if p.outcome == 'pass' else 'bad' }}">{{ p.outcome }}</td><td>{{ fmt(p.peak_mb, 5) }}</td><td>{{ fmt(p.peak_rss_mb, 5) }}</td><td>{{ fmt(p.peak_gpu_mb, 5) }}</td><td>{{ fmt(p.duration_s) }}</td><td>{{ p.detail }}</td></tr>
{% endfor %}</table>
{% if images.get("headroom") %}<img alt="{{ titles.headroom }}" src="data:image/png;base64,{{ images.headroom }}">{% endif %}
{% endif %}
{% if images.get("loss") %}<h2>{{ titles.loss }}</h2><img alt="{{ titles.loss }}" src="data:image/png;base64,{{ images.loss }}">{% endif %}
{% if compare.results %}<h2>Compared with the baseline</h2><p class="meta">{{ compare.baseline }}</p><ul>
{% for r in compare.results %}<li class="{{ 'bad' if r.regressed else '' }}">{{ r.text }}</li>{% endfor %}</ul>{% endif %}
{% if d.saved_baseline %}<p>Saved as this machine's baseline: {{ d.saved_baseline }}</p>{% endif %}
<h2>Notes</h2><ul>{% for n in d.notes %}<li>{{ n }}</li>{% endfor %}</ul>
</body></html>
"""


def _env() -> Any:
    import jinja2

    return jinja2.Environment(autoescape=False, keep_trailing_newline=True, undefined=jinja2.StrictUndefined)


def render_markdown(data: dict[str, Any]) -> str:
    """The Markdown report (fits a PR comment)."""
    text = _env().from_string(_MARKDOWN).render(**_context(data))
    while "\n\n\n" in text:
        text = text.replace("\n\n\n", "\n\n")
    return text


def render_html(data: dict[str, Any], plots: dict[str, bytes]) -> str:
    """The self-contained HTML page with ``plots`` embedded."""
    import jinja2

    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    images = {k: base64.b64encode(v).decode("ascii") for k, v in plots.items()}
    return env.from_string(_HTML).render(**_context(data), images=images, titles=PLOTS)


def write_reports(data: dict[str, Any], run_dir: Path, latest_dir: Path) -> dict[str, str]:
    """Write profile.{json,md,html} (and the PNGs) into ``run_dir`` and latest.{json,md,html}
    into ``latest_dir``, each atomically. Returns the paths by kind. A file that cannot be
    written there (read-only, full disk) is said on stderr and goes to the temp-directory
    fallback, whose path is returned instead
    (:func:`~trainguard._internal.atomic.write_or_fallback`)."""
    plots = render_plots(data)
    paths = {
        "json": str(run_dir / "profile.json"),
        "markdown": str(run_dir / "profile.md"),
        "html": str(run_dir / "profile.html"),
        "latest_json": str(latest_dir / "latest.json"),
        "latest_markdown": str(latest_dir / "latest.md"),
        "latest_html": str(latest_dir / "latest.html"),
    }
    data = dict(data, reports=paths)
    text_json = json.dumps(data, indent=2, default=str) + "\n"
    text_md = render_markdown(data)
    text_html = render_html(data, plots)
    for name, png in plots.items():
        write_or_fallback(run_dir / f"{name}.png", png, what=f"the profile plot {name}")
    for kind, text in (("json", text_json), ("markdown", text_md), ("html", text_html)):
        for key in (kind, f"latest_{kind}"):
            written = write_or_fallback(paths[key], text, what=f"the profile report ({kind})")
            if written.path is not None:
                paths[key] = str(written.path)
    return paths
