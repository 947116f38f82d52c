"""The benchmark's report: a table on the terminal, a JSON file, and a PNG plot.

Every figure comes from :func:`~twostroke.engine.bench.metrics.metrics`; this module only lays
them out. Each system's throughput is also given as a ratio to one reference system (twostroke
depth 2 when it ran), because the targets of the project are ratios measured in one run on one
machine, where absolute numbers drift with the machine's load. A system that did not run gets
a row that says why, never an empty one. When the run measured the machine's roof
(:mod:`~twostroke.engine.bench.roof`), each system's throughput is also given as a fraction of
the roof's, in the table, the JSON and the plot, and a line under the table says how the roof
was found. A speculating system also shows its mean acceptance length, and a line under the
table compares it with the same system without speculation
(:mod:`~twostroke.engine.bench.speculation`: TPOT and throughput ratios, the greedy check).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
from rich.console import Console
from rich.table import Table

from twostroke.engine.bench.metrics import (
    Distribution,
    Metrics,
    RequestTiming,
    SystemResult,
    metrics,
)
from twostroke.engine.bench.record import BenchRun
from twostroke.engine.bench.speculation import SpeculationComparison, compare_speculation

__all__ = [
    "DEFAULT_REFERENCE",
    "ReportFiles",
    "choose_reference",
    "compute_metrics",
    "notes",
    "render_table",
    "report_document",
    "write_plot",
    "write_report",
]

#: The system ratios are given against, when it ran.
DEFAULT_REFERENCE = "twostroke-depth2"

#: Format version of the JSON file.
JSON_FORMAT = 1


@attrs.frozen
class ReportFiles:
    """What :func:`write_report` wrote.

    Attributes:
        json: The JSON file.
        png: The plot, or ``None`` when it could not be drawn.
        plot_message: Where the plot is, or why there is none.
        speculation: Each speculating system against itself without speculation
            (:func:`~twostroke.engine.bench.speculation.compare_speculation`).
    """

    json: Path
    png: Path | None
    plot_message: str
    speculation: tuple[SpeculationComparison, ...] = ()


def compute_metrics(
    run: BenchRun, *, ttft_slo: float | None = None, tpot_slo: float | None = None
) -> dict[str, Metrics]:
    """The metrics of every system that ran, by name, in run order."""
    return {
        result.name: metrics(result, ttft_slo=ttft_slo, tpot_slo=tpot_slo)
        for result in run.results
        if result.available
    }


def choose_reference(figures: Mapping[str, Metrics], preferred: str | None) -> str | None:
    """The system ratios are taken against: ``preferred`` if it ran, else the first that ran."""
    if preferred is not None and preferred in figures:
        return preferred
    return next(iter(figures), None)


def _ms(distribution: Distribution | None, *fields: str) -> str:
    if distribution is None:
        return "-"
    return " / ".join(f"{getattr(distribution, field) * 1000:.0f}" for field in fields)


def _s(distribution: Distribution | None, *fields: str) -> str:
    if distribution is None:
        return "-"
    return " / ".join(f"{getattr(distribution, field):.2f}" for field in fields)


def _note(extra: Mapping[str, Any]) -> str:
    parts = [str(extra[key]) for key in ("weights", "batching") if key in extra]
    if "batch_size" in extra:
        parts.append(f"batch {extra['batch_size']}")
    if "batch_invariant" in extra:
        parts.append("batch-invariant" if extra["batch_invariant"] else "not batch-invariant")
    if extra.get("load_average") is not None:
        parts.append(f"load average {extra['load_average']:.2f}")
    if extra.get("machine_gflops"):
        probes = " -> ".join(f"{probe:.0f}" for probe in extra["machine_gflops"])
        parts.append(f"machine {probes} GFLOPS before -> after")
    if "masked_tokens" in extra:
        parts.append(
            f"{extra['masked_tokens']} tokens under a JSON schema: masks "
            f"{extra['mask_fill_ms_per_token']:.3f} ms/token to fill, "
            f"{extra['mask_wait_s']:.2f} s waited for at sampling"
        )
    return "; ".join(parts)


def render_table(run: BenchRun, figures: Mapping[str, Metrics], reference: str | None) -> Table:
    """One row per system: figures and throughput ratio for those that ran.

    Latencies are milliseconds, end-to-end in seconds; each cell is "mean / p99" (ITL "p50 /
    p99", the gaps are many and skewed). What a reader needs to interpret a row (quantized
    weights, no batching) and why a system did not run go in :func:`notes`, under the table.
    """
    slos = next(iter(figures.values())).goodput is not None if figures else False
    table = Table(
        title=f"twostroke bench: {run.model.name}, {run.model.dtype}, {run.model.threads} threads",
        caption=run.workload.description,
    )
    table.add_column("system", style="bold", no_wrap=True)
    headers = ["startup s", "wall s", "out tok/s", f"× {reference or 'ref'}"]
    headers += ["% roof"] * (run.roof is not None) + ["req/s"]
    headers += ["TTFT ms", "TPOT ms", "ITL ms p50", "E2E s"]
    speculating = any(_ACCEPTANCE in result.extra for result in run.results)
    headers += ["accept len (drafts)"] * speculating
    quality = run.quality is not None
    headers += ["greedy = ref"] * quality
    for header in headers:
        table.add_column(header, justify="right", no_wrap=True)
    if slos:
        table.add_column("goodput req/s", justify="right", no_wrap=True)
    base = figures[reference].output_throughput if reference else None
    for result in run.results:
        figure = figures.get(result.name)
        if figure is None:
            table.add_row(result.name, "[red]not run[/red]", *["-"] * (len(headers) - 1 + slos))
            continue
        cells = [
            _system_cell(result),
            f"{figure.startup_seconds:.1f}",
            f"{figure.wall_seconds:.2f}",
            f"{figure.output_throughput:.1f}",
            "-" if not base else f"{figure.output_throughput / base:.2f}",
            *_roof_cell(run, result.name, figure),
            f"{figure.request_throughput:.2f}",
            _ms(figure.ttft, "mean", "p99"),
            _ms(figure.tpot, "mean", "p99"),
            _ms(figure.itl, "p50", "p99"),
            _s(figure.e2e, "mean", "p99"),
            *[_acceptance_cell(result.extra)] * speculating,
            *([_quality_cell(run, result)] if quality else []),
        ]
        if slos:
            cells.append("-" if figure.goodput is None else f"{figure.goodput:.2f}")
        table.add_row(*cells)
    return table


#: The key of a speculating system's mean acceptance length in its result's ``extra``.
_ACCEPTANCE = "spec_decode_mean_acceptance_length"


def _acceptance_cell(extra: Mapping[str, Any]) -> str:
    """A speculating system's mean acceptance length (1 + accepted / drafts) and drafts;
    "-" for a system that does not speculate or does not count them."""
    if _ACCEPTANCE not in extra:
        return "-"
    return f"{extra[_ACCEPTANCE]:.2f} ({extra['spec_decode_drafts']})"


def _quality_cell(run: BenchRun, result: SystemResult) -> str:
    """Requests whose greedy outputs equal the reference's, and the share of its tokens
    agreed on before the first differences; "-" where the system reports no tokens."""
    assert run.quality is not None
    found = run.quality.of(result.output_token_ids)
    return "-" if found is None else found.cell()


def _system_cell(result: SystemResult) -> str:
    """The system's name, with its weight format when it computes with its own (llama.cpp's
    GGUF types: not the run's dtype, so not the same arithmetic as the rows around it)."""
    weight_format = result.extra.get("weight_format")
    return result.name if weight_format is None else f"{result.name} ({weight_format})"


def _roof_cell(run: BenchRun, name: str, figure: Metrics) -> list[str]:
    """The "% roof" cell of the system ``name`` against its own roof (marked where it ran
    faster than it: a roof too low is no fraction), or no cell when the run has no roof."""
    if run.roof is None:
        return []
    return [run.roof.percent(figure.output_throughput, name)]


def _over_roof(run: BenchRun, figures: Mapping[str, Metrics]) -> list[str]:
    """The systems that ran faster than their roof, but for speculating ones (their own line
    says why: the roof's schedule has no drafts)."""
    roof = run.roof
    if roof is None:
        return []
    speculating = {result.name for result in run.results if _ACCEPTANCE in result.extra}
    return [
        name
        for name, figure in figures.items()
        if name not in speculating and roof.exceeded(figure.output_throughput, name)
    ]


def notes(run: BenchRun) -> list[str]:
    """One line per system that did not run (why) or whose figures need a word (how)."""
    lines = []
    for result in run.results:
        if not result.available:
            lines.append(f"{result.name}: not run: {result.reason}")
        elif note := _note(result.extra):
            lines.append(f"{result.name}: {note}")
    return lines


def report_document(
    run: BenchRun, figures: Mapping[str, Metrics], reference: str | None
) -> dict[str, Any]:
    """Everything the run measured, as one JSON-ready document (raw timings included)."""
    base = figures[reference].output_throughput if reference else None
    workload = run.workload
    systems = []
    for result in run.results:
        figure = figures.get(result.name)
        entry = result.to_json()
        entry["metrics"] = None if figure is None else figure.to_json()
        entry["ratio_to_reference"] = (
            figure.output_throughput / base if figure is not None and base else None
        )
        entry["fraction_of_roof"] = (
            run.roof.fraction(figure.output_throughput, result.name)
            if figure is not None and run.roof is not None
            else None
        )
        entry["over_roof"] = entry["fraction_of_roof"] is not None and entry["fraction_of_roof"] > 1
        found = None if run.quality is None else run.quality.of(result.output_token_ids)
        entry["quality"] = None if found is None else found.to_json()
        systems.append(entry)
    return {
        "format": JSON_FORMAT,
        "started_at": run.started_at,
        "machine": dict(run.machine),
        "model": {
            "name": run.model.name,
            "source": str(run.model.source),
            "dtype": run.model.dtype,
            "threads": run.model.threads,
        },
        "workload": {
            "description": workload.description,
            "seed": workload.seed,
            "offline": workload.is_offline,
            "arrival_times": None
            if workload.arrival_times is None
            else list(workload.arrival_times),
            "requests": [
                {"prompt_tokens": len(r.prompt_token_ids), "max_tokens": r.max_tokens}
                for r in workload.requests
            ],
        },
        "reference": reference,
        "roof": None if run.roof is None else run.roof.to_json(),
        "quality_reference": None if run.quality is None else run.quality.to_json(),
        "systems": systems,
        "speculation": [c.to_json() for c in compare_speculation(run, figures)],
    }


def write_plot(
    run: BenchRun, figures: Mapping[str, Metrics], reference: str | None, path: Path
) -> str | None:
    """Draw throughput bars and latency CDFs (TTFT, TPOT, end-to-end) to ``path``.

    Returns:
        ``None`` when drawn, else why not (matplotlib missing, nothing ran).
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return "no plot: matplotlib is not installed (pip install matplotlib, or the bench extra)"
    if not figures:
        return "no plot: no system ran"
    figure = Figure(figsize=(13, 9), layout="constrained")
    axes = figure.subplots(2, 2)
    names = list(figures)
    by_name = {result.name: result for result in run.results}
    shown = {name: _system_cell(by_name[name]) for name in names}  # as in the table's rows
    throughputs = [figures[name].output_throughput for name in names]
    bars = axes[0][0].bar([shown[name] for name in names], throughputs, color="tab:blue")
    base = figures[reference].output_throughput if reference else None
    labels = [f"{value:.0f}" + (f"\n×{value / base:.2f}" if base else "") for value in throughputs]
    if run.roof is not None:
        roof = run.roof
        labels = [f"{label}\n" + ("over its roof (too low)" if roof.exceeded(value, name) else
                  f"{roof.percent(value, name)} % of roof") for label, value, name in
                  zip(labels, throughputs, names, strict=True)]  # fmt: skip
        axes[0][0].axhline(roof.output_throughput, color="tab:red", linestyle="--")
        axes[0][0].annotate(
            f"roof {roof.output_throughput:.0f} tok/s",
            (0, roof.output_throughput),
            xycoords=("axes fraction", "data"),
            xytext=(4, 4),
            textcoords="offset points",
            color="tab:red",
        )
    axes[0][0].bar_label(bars, labels=labels)
    axes[0][0].set_ylabel("output tokens / s")
    axes[0][0].set_title("throughput" + (f" (ratio to {reference})" if reference else ""))
    axes[0][0].tick_params(axis="x", labelrotation=20)
    axes[0][0].margins(y=0.2)
    panels: tuple[tuple[Any, str, Callable[[RequestTiming], float | None]], ...] = (
        (axes[0][1], "TTFT", lambda t: t.ttft),
        (axes[1][0], "TPOT", lambda t: t.tpot),
        (axes[1][1], "end-to-end latency", lambda t: t.e2e),
    )
    for axis, title, value in panels:
        for name in names:
            values = sorted(v for t in by_name[name].timings if (v := value(t)) is not None)
            if values:
                # The empirical CDF: 0 up to the fastest request, 1 from the slowest on.
                fractions = [0.0] + [(i + 1) / len(values) for i in range(len(values))]
                axis.step([values[0], *values], fractions, where="post", label=shown[name])
        axis.set_xlabel("seconds")
        axis.set_ylabel("fraction of requests")
        axis.set_title(f"{title} CDF")
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    figure.suptitle(f"{run.model.name} ({run.model.dtype}): {run.workload.description}")
    figure.savefig(path, dpi=100)
    return None


def write_report(
    run: BenchRun,
    out_dir: Path,
    *,
    reference: str | None = DEFAULT_REFERENCE,
    ttft_slo: float | None = None,
    tpot_slo: float | None = None,
    console: Console | None = None,
) -> ReportFiles:
    """Print the table and write ``bench.json`` and ``bench.png`` into ``out_dir``.

    Args:
        run: What the systems reported.
        out_dir: Where the files go (created if missing).
        reference: The system ratios are taken against; the first that ran if it did not.
        ttft_slo: TTFT target for goodput, seconds.
        tpot_slo: TPOT target for goodput, seconds.
        console: Where the table is printed; a new stdout console if ``None``.

    Returns:
        The files written, the plot's message, and each speculating system against itself
        without speculation (printed under the table; a greedy check that found different
        outputs in bold red).
    """
    console = console or Console()
    figures = compute_metrics(run, ttft_slo=ttft_slo, tpot_slo=tpot_slo)
    chosen = choose_reference(figures, reference)
    console.print(render_table(run, figures, chosen))
    if run.roof is not None:
        console.print(run.roof.summary(), highlight=False)
        if over := _over_roof(run, figures):
            console.print(
                f"roof: {', '.join(over)} ran faster than its roof, which no run can: the "
                "roof is too low (a probe that under-read, or work the cost model does not "
                "see), so the column says so rather than a fraction",
                style="bold red",
                highlight=False,
            )
        if not run.workload.is_offline:
            console.print(
                "(serving: the arrivals pace every system, so its fraction of the roof "
                "measures the load offered, not the kernels)",
                highlight=False,
            )
    for line in notes(run):
        console.print(line, highlight=False)
    if run.roof is not None and any(_ACCEPTANCE in result.extra for result in run.results):
        console.print(
            "(a speculating row verifies several tokens a step: the roof is the floor of a "
            "schedule without drafts, which it can pass)",
            highlight=False,
        )
    comparisons = compare_speculation(run, figures)
    for comparison in comparisons:
        style = "bold red" if comparison.outputs_differ else None
        console.print(comparison.describe(), style=style, highlight=False)
    if reference is not None and chosen != reference and chosen is not None:
        console.print(f"(ratios are to {chosen}: {reference} did not run)")
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "bench.json"
    json_path.write_text(json.dumps(report_document(run, figures, chosen), indent=1))
    png_path = out_dir / "bench.png"
    why_not = write_plot(run, figures, chosen, png_path)
    message = f"plot: {png_path}" if why_not is None else why_not
    console.print(f"results: {json_path}\n{message}")
    return ReportFiles(
        json=json_path,
        png=png_path if why_not is None else None,
        plot_message=message,
        speculation=tuple(comparisons),
    )
