"""Sweep report: mean ± std over seeds of each configuration of one or more Hydra multiruns.

    python -m src.reporting.report multirun/<date>/<time> [more sweep dirs or quoted globs] [--out DIR] [--by-sweep]
    python -m src.reporting.report          # the newest sweep under multirun/ that has results (it says which)

A job is a directory (at any depth below a given path) holding `.hydra/overrides.yaml`. It counts
when its `metrics.json` has status "completed"; otherwise it is listed as failed/unfinished and
never averaged in. A configuration is the job's overrides minus `seed=...`, pooled across all
given sweeps unless --by-sweep keeps sweeps apart (and adds a sweep column).

Columns: the metrics below (plus peak_mem_gb, tflops_per_gpu and mfu when the jobs report them), the
model as configured, and world size, max_epochs, optimizer and scheduler when they differ between rows.

std is the sample standard deviation (ddof=1). With a single value it is undefined: None in the
rows, an empty cell in results.csv, "—" in results.md and no error bar in results.png.

Writes results.md, results.csv and results.png into the first sweep directory, or into --out.
"""

import argparse
import csv
import glob
import json
import math
import re
import statistics
import sys
from pathlib import Path

import yaml

METRICS = (
    "val_top1",
    "test_loss",
    "test_top1",
    "test_top5",
    "sec_per_epoch",
    "images_per_sec",
)  # val: what a search picks by
OPTIONAL_METRICS = (
    "train_sec",
    "peak_mem_gb",
    "peak_host_mem_gb",
    "tflops_per_gpu",
    "mfu",
)  # a column only when some job reports it
FORMATS = {
    "val_top1": ".2f",
    "test_loss": ".4f",
    "test_top1": ".2f",
    "test_top5": ".2f",
    "sec_per_epoch": ".3f",
    "images_per_sec": ".1f",
    "train_sec": ".2f",
    "peak_mem_gb": ".2f",
    "peak_host_mem_gb": ".2f",
    "tflops_per_gpu": ".1f",
    "mfu": ".3f",
}
# What a row was trained with beyond its overrides (an experiment= preset or a default sets these).
SETTINGS = ("model", "world_size", "max_epochs", "optimizer", "scheduler")


class ReportError(Exception):
    """A bad command-line path; main() prints it as one line and exits 2."""


def find_jobs(path) -> list:
    """Job directories at or below `path` (those holding .hydra/overrides.yaml), sorted."""
    return sorted(p.parent.parent for p in Path(path).rglob(".hydra/overrides.yaml"))


def _is_seed(override: str) -> bool:
    return override.lstrip("+~").split("=", 1)[0] == "seed"


def load_job(job_dir) -> dict:
    """One job: its overrides (config without seed, and the seed), final metrics, and the reason it
    does not count (`problem`, None when it completed)."""
    job_dir = Path(job_dir)
    try:
        overrides = yaml.safe_load((job_dir / ".hydra" / "overrides.yaml").read_text()) or []
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        overrides = None
    unreadable = not isinstance(overrides, list)
    overrides = [] if unreadable else [str(o) for o in overrides]
    job = {
        "dir": job_dir,
        "sweep": str(job_dir.parent),
        "overrides": tuple(sorted(o for o in overrides if not _is_seed(o))),
        "seed": next((o.split("=", 1)[1] for o in overrides if _is_seed(o)), None),
        "final": None,
        "problem": None,
        "settings": {},
    }
    path = job_dir / "metrics.json"
    if unreadable:
        job["problem"] = "unreadable .hydra/overrides.yaml (not the list of overrides Hydra writes)"
        return job
    if not path.is_file():
        job["problem"] = "no metrics.json (crashed, killed or still running)"
        return job
    try:
        metrics = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        job["problem"] = f"unreadable metrics.json ({e})"
        return job
    status = metrics.get("status") if isinstance(metrics, dict) else None
    if status != "completed":
        job["problem"] = f"status={status}"
    else:
        job["final"] = metrics.get("final") or {}
        job["problem"] = _not_metrics(job["final"])
        job["settings"] = _settings(job_dir, metrics)
    return job


def _not_metrics(final) -> str | None:
    """Why a completed job's `final` is not what train.py writes (a number or null per metric), or None."""
    if not isinstance(final, dict):
        return f"metrics.json's final is {type(final).__name__}, not the metrics train.py writes"
    for m in METRICS + OPTIONAL_METRICS:
        value = final.get(m)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return f"metrics.json's final {m} is {value!r}, not a number as train.py writes"
    return None


def _settings(job_dir: Path, metrics: dict) -> dict:
    """SETTINGS of one job (None where unknown), from the metrics' hparams, else Hydra's config group choices
    (.hydra/hydra.yaml), else the resolved config; other hparams keys are ignored."""
    hparams = metrics.get("hparams") if isinstance(metrics.get("hparams"), dict) else {}
    config = metrics.get("config") if isinstance(metrics.get("config"), dict) else {}
    try:
        hydra = yaml.safe_load((job_dir / ".hydra" / "hydra.yaml").read_text()) or {}
        choices = hydra["hydra"]["runtime"]["choices"] or {}
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        choices = {}

    def section(name) -> dict:
        return config.get(name) if isinstance(config.get(name), dict) else {}

    def chosen(group):  # e.g. optim=sgd; torch.optim.SGD -> SGD for jobs without .hydra/hydra.yaml
        return choices.get(group) or (str(section(group).get("_target_", "")).rsplit(".", 1)[-1] or None)

    model = hparams.get("model")  # older jobs: the class name (TinyCNN), so Hydra's choice comes first
    if choices.get("model"):
        name = section("model").get("name")  # model=torchvision: the name tells which
        model = f"{choices['model']}:{name}" if name else choices["model"]
    return {
        "model": model,
        "world_size": hparams.get("world_size"),
        "max_epochs": hparams.get("max_epochs", section("trainer").get("max_epochs")),
        "optimizer": hparams.get("optim") or chosen("optim"),
        "scheduler": hparams.get("scheduler") or chosen("scheduler"),
    }


def failed_jobs(job_dirs) -> list:
    """(job_dir, reason) of every job that did not complete."""
    return [(job["dir"], job["problem"]) for job in map(load_job, job_dirs) if job["problem"]]


def _natural(text: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def aggregate(job_dirs, by_sweep: bool = False) -> list:
    """One row (dict) per configuration with at least one completed job, sorted by configuration.

    Keys: config (overrides minus seed, comma-joined), overrides (tuple), sweep (None unless
    by_sweep), n (completed jobs), n_failed, seeds, each of SETTINGS (its values over the jobs joined by
    "/", None if unknown), and for each metric m of METRICS and OPTIONAL_METRICS: m_mean, m_std (sample
    std, None when fewer than 2 values), m_n (jobs that reported m)."""
    groups = {}
    for job in map(load_job, job_dirs):
        key = (job["sweep"] if by_sweep else None, job["overrides"])
        groups.setdefault(key, []).append(job)
    rows = []
    for (sweep, overrides), jobs in groups.items():
        done = [j for j in jobs if j["problem"] is None]
        if not done:
            continue
        row = {
            "config": ",".join(overrides),
            "overrides": overrides,
            "sweep": sweep,
            "n": len(done),
            "n_failed": len(jobs) - len(done),
            "seeds": sorted((j["seed"] for j in done if j["seed"] is not None), key=_natural),
        }
        for key in SETTINGS:
            values = sorted({str(j["settings"][key]) for j in done if j["settings"].get(key) is not None}, key=_natural)
            row[key] = "/".join(values) or None
        for m in METRICS + OPTIONAL_METRICS:
            values = [float(j["final"][m]) for j in done if j["final"].get(m) is not None]
            row[f"{m}_n"] = len(values)
            row[f"{m}_mean"] = statistics.fmean(values) if values else None
            row[f"{m}_std"] = statistics.stdev(values) if len(values) > 1 else None
        rows.append(row)
    return sorted(rows, key=lambda r: (r["sweep"] or "", _natural(r["config"])))


def _labels(rows) -> tuple:
    """Short row labels (overrides shared by every row left out) and the shared overrides."""
    common = set.intersection(*(set(r["overrides"]) for r in rows)) if len(rows) > 1 else set()
    labels = [
        ",".join(o for o in r["overrides"] if o not in common)
        or ("(common overrides)" if r["overrides"] else "(no overrides)")
        for r in rows
    ]
    return labels, sorted(common)


def _metric_columns(rows) -> list:
    """METRICS, then each optional metric that some row reports."""
    return list(METRICS) + [m for m in OPTIONAL_METRICS if any(r[f"{m}_n"] for r in rows)]


def _setting_columns(rows) -> tuple:
    """(SETTINGS shown as columns, "key=value" of those equal in every row): the model whenever known, the
    others only when rows differ; unknown everywhere -> neither."""
    shown, common = [], []
    for key in SETTINGS:
        values = {r[key] for r in rows}
        if not values - {None}:
            continue
        if key == "model" or len(values) > 1:
            shown.append(key)
        else:
            common.append(f"{key}={values.pop()}")
    return shown, common


def _cell(row, m) -> str:
    mean, std = row[f"{m}_mean"], row[f"{m}_std"]
    if mean is None:
        return "—"
    return f"{mean:{FORMATS[m]}} ± " + ("—" if std is None else f"{std:{FORMATS[m]}}")


def to_markdown(rows, failed, sweeps, by_sweep=False) -> str:
    labels, common = _labels(rows)
    settings, same = _setting_columns(rows)
    metrics = _metric_columns(rows)
    text_cols = ["sweep", "configuration", *settings]
    head = (["sweep"] if by_sweep else []) + ["configuration", *settings, "n", "failed", *metrics]
    lines = ["# Sweep report", "", "Sweeps: " + ", ".join(f"`{s}`" for s in sweeps)]
    if common:
        lines.append("Overrides common to all rows: " + ", ".join(f"`{o}`" for o in common))
    if same:
        lines.append("Settings common to all rows: " + ", ".join(f"`{o}`" for o in same))
    lines += ["", "| " + " | ".join(head) + " |", "|" + "".join("---|" if h in text_cols else "---:|" for h in head)]
    for row, label in zip(rows, labels):
        cells = ([f"`{row['sweep']}`"] if by_sweep else []) + [f"`{label}`"]
        cells += ["—" if row[k] is None else str(row[k]) for k in settings] + [str(row["n"]), str(row["n_failed"])]
        lines.append("| " + " | ".join(cells + [_cell(row, m) for m in metrics]) + " |")
    if not rows:
        lines.append("| (no completed jobs) |" + " |" * (len(head) - 1))
    lines += [
        "",
        "Cells are mean ± sample std (ddof=1) over seeds; std is — when n=1. "
        "Failed or unfinished jobs are not averaged in.",
        "",
    ]
    lines.append(f"## Failed or unfinished jobs: {len(failed)}")
    lines += [f"- `{d}`: {reason}" for d, reason in failed]
    return "\n".join(lines) + "\n"


CSV_FIRST_COLUMNS = ("config", "n", "n_failed", "seeds")  # after "sweep" with --by-sweep


def write_csv(rows, path, by_sweep=False) -> None:
    cols = (["sweep"] if by_sweep else []) + list(CSV_FIRST_COLUMNS)
    cols += [k for k in SETTINGS if any(r[k] is not None for r in rows)]  # all known, equal or not
    cols += [f"{m}_{s}" for m in _metric_columns(rows) for s in ("mean", "std", "n")]
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(cols)
        for r in rows:
            values = {**r, "seeds": " ".join(r["seeds"])}
            out.writerow(["" if values[c] is None else values[c] for c in cols])


def make_figure(rows):
    """Two horizontal bar charts, one bar per configuration: test top-1 and images/s, mean ± std, each
    value written right of its error bar. The accuracy axis is zoomed to the data; throughput starts at 0."""
    from matplotlib.figure import Figure  # renders with the Agg canvas; no pyplot, no display

    labels = [f"{Path(r['sweep']).name}: {label}" if r["sweep"] else label for r, label in zip(rows, _labels(rows)[0])]
    fig = Figure(figsize=(12, 1.5 + 0.45 * max(len(rows), 1)), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    panels = (
        ("test_top1", "test top-1 accuracy (%)", "tab:blue", True),
        ("images_per_sec", "throughput (images/s)", "tab:orange", False),
    )
    for ax, (m, title, color, zoom) in zip(axes, panels):
        means = [math.nan if r[f"{m}_mean"] is None else r[f"{m}_mean"] for r in rows]
        stds = [math.nan if r[f"{m}_std"] is None else r[f"{m}_std"] for r in rows]  # nan: no error bar
        ends = [mean if math.isnan(std) else mean + std for mean, std in zip(means, stds)]
        known = [(2 * mean - end, end) for mean, end in zip(means, ends) if not math.isnan(mean)]
        lo, hi = (min(k[0] for k in known), max(k[1] for k in known)) if known else (0.0, 1.0)
        left = max(0.0, lo - 0.15 * (hi - lo or 1.0)) if zoom else 0.0  # differences of 0.1 % stay visible
        ax.set_xlim(left, max(hi, left + 1e-9))
        ax.barh(range(len(rows)), means, xerr=stds, capsize=4, color=color, alpha=0.5)
        texts = [
            ax.annotate(
                f"{_cell(row, m)}  (n={row[f'{m}_n']})",
                (left if math.isnan(end) else end, y),
                xytext=(5, 0),
                textcoords="offset points",
                va="center",
            )
            for y, (row, end) in enumerate(zip(rows, ends))
        ]
        ax.set_title(title + ", mean ± std over seeds")
        ax.set_yticks(range(len(rows)), labels)
        ax.grid(axis="x", alpha=0.3)
        if not rows:
            ax.text(0.5, 0.5, "no completed jobs", ha="center", transform=ax.transAxes)
        _make_room(fig, ax, texts)
    axes[0].invert_yaxis()  # first configuration on top (the y axis is shared: invert once)
    return fig


def _make_room(fig, ax, texts) -> None:
    """Widen the x axis on the right so that every label fits inside it (labels are sized in pixels)."""
    fig.draw_without_rendering()  # lays the figure out: text and axes sizes in pixels
    left, right = ax.get_xlim()
    width = ax.bbox.width
    for text in texts:
        anchor = ax.transData.transform((text.xy[0], 0))[0]
        needed = text.get_window_extent().x1 - anchor + 0.03 * width  # label plus a margin, in pixels
        if needed < 0.9 * width:  # otherwise no axis range fits it: leave it cut off
            right = max(right, left + (text.xy[0] - left) * width / (width - needed))
    ax.set_xlim(left, right)


PNG_SOFTWARE = "ddplab report"  # the PNG's Software text chunk: how a later report knows the file is its own


def write_png(rows, path) -> None:
    make_figure(rows).savefig(path, dpi=100, format="png", metadata={"Software": PNG_SOFTWARE})


def _written_by_a_report(path: Path) -> bool:
    """Whether results.md/.csv/.png at `path` is what this report writes (then it may be replaced)."""
    with open(path, "rb") as f:
        head = f.read(4096)
    if path.suffix == ".md":
        return head.startswith(b"# Sweep report")
    if path.suffix == ".csv":
        first = ",".join(CSV_FIRST_COLUMNS).encode()
        return head.startswith((first, b"sweep," + first))
    if b"Software\x00" + PNG_SOFTWARE.encode() in head:
        return True
    # earlier reports did not tag their PNG: one beside a report's results.md is theirs
    beside = path.with_name("results.md")
    return head.startswith(b"\x89PNG") and beside.is_file() and _written_by_a_report(beside)


def write_results(out: Path, markdown: str, rows, by_sweep: bool) -> list[Path]:
    """results.md, results.csv and results.png in `out`, each written whole then moved into place. A file of
    that name that a report did not write is left alone: a ReportError names it."""
    paths = [out / name for name in ("results.md", "results.csv", "results.png")]
    for path in paths:
        if path.is_dir() or (path.exists() and not _written_by_a_report(path)):
            raise ReportError(f"{path} is not a report's {path.suffix} file; move it, or pass --out DIR")
    writers = (
        lambda tmp: tmp.write_text(markdown),
        lambda tmp: write_csv(rows, tmp, by_sweep),
        lambda tmp: write_png(rows, tmp),
    )
    for path, write in zip(paths, writers):
        tmp = path.with_name(f".{path.name}.partial")
        write(tmp)
        tmp.replace(path)
    return paths


def _sweep_dirs(args) -> list:
    """(sweep_dir, job_dirs) for each argument; a quoted glob may stand for several sweeps."""
    sweeps = []
    for arg in args:
        if any(c in arg for c in "*?["):
            paths = [p for p in sorted(glob.glob(arg)) if Path(p).is_dir()]
            if not paths:
                raise ReportError(f"{arg}: no directory matches this pattern")
        else:
            paths = [arg]
        for p in paths:
            if not Path(p).is_dir():
                raise ReportError(f"{p}: no such directory")
            jobs = find_jobs(p)
            if not jobs:
                raise ReportError(f"{p}: holds no jobs (no <job>/.hydra/overrides.yaml below it)")
            sweeps.append((Path(p), jobs))
    return sweeps


def newest_sweep(root="multirun"):
    """The newest `<root>/<date>/<time>` with at least one metrics.json below it, or None. Hydra names
    sweeps by date and time, so the names sort by age; a newer sweep without results (running, or every
    job crashed) is passed over."""
    sweeps = sorted((p for p in Path(root).glob("*/*") if p.is_dir()), key=lambda p: _natural(p.as_posix()))
    return next((p for p in reversed(sweeps) if next(p.rglob("metrics.json"), None)), None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m src.reporting.report", description=__doc__.split("\n")[0])
    parser.add_argument(
        "sweeps",
        nargs="*",
        help="sweep directories (multirun/<date>/<time>) or quoted globs; "
        "default: the newest sweep under multirun/ with results",
    )
    parser.add_argument(
        "--out", help="directory for results.md/.csv/.png (default: the sweep's own directory; needed for several)"
    )
    parser.add_argument("--by-sweep", action="store_true", help="keep the same configuration in different sweeps apart")
    args = parser.parse_args(argv)
    try:
        if not args.sweeps:
            newest = newest_sweep()
            if newest is None:
                raise ReportError(
                    "no sweep with results under multirun/ (no multirun/<date>/<time>/.../metrics.json);"
                    " pass a sweep directory"
                )
            print(f"report: the newest sweep with results: {newest}", file=sys.stderr)
            args.sweeps = [str(newest)]
        sweeps = _sweep_dirs(args.sweeps)
        if len(sweeps) > 1 and not args.out:  # a pooled table must not replace one sweep's own results
            raise ReportError(f"{len(sweeps)} sweeps pooled: pass --out DIR for their table (each keeps its own)")
    except ReportError as e:
        print(f"report: error: {e}", file=sys.stderr)
        return 2
    seen, job_dirs = set(), []
    for _, jobs in sweeps:  # overlapping arguments must not count a job twice
        for job in jobs:
            if job.resolve() not in seen:
                seen.add(job.resolve())
                job_dirs.append(job)

    rows = aggregate(job_dirs, by_sweep=args.by_sweep)
    failed = failed_jobs(job_dirs)
    out = Path(args.out) if args.out else sweeps[0][0]
    markdown = to_markdown(rows, failed, [str(s) for s, _ in sweeps], args.by_sweep)
    try:
        out.mkdir(parents=True, exist_ok=True)
        written = write_results(out, markdown, rows, args.by_sweep)
    except ReportError as e:
        print(f"report: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"report: error: cannot write into {out} ({e.strerror}); pass --out DIR", file=sys.stderr)
        return 2
    print(markdown)
    print(f"wrote {', '.join(map(str, written))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
