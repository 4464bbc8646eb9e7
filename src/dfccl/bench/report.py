"""How ``dfccl bench`` reports: the nccl-tests-style table, the JSON rows,
the Markdown summary and the plot."""

from __future__ import annotations


from dfccl.bench.config import KINDS, Case, bus_factor
from dfccl.bench.floor import floor_ratio, format_floor_line, format_ratio

__all__ = ["NCCL_UNAVAILABLE_NO_GPU", "ReportError", "finish_row", "format_markdown", "format_row",
           "format_table_header", "nccl_unavailable_line", "plot_figure", "plot_title", "timing_line", "write_plot"]
NCCL_UNAVAILABLE_NO_GPU = "no GPU/torch"


# -- output -------------------------------------------------------------------------------------------
_HEAD_COLS = f"{'size':>12} {'count':>12} {'type':>9} {'redop':>6} {'root':>5}"
_DF_COLS = f"{'time':>9} {'/floor':>7} {'algbw':>7} {'busbw':>7} {'#wrong':>7}"
_NCCL_COLS = f"{'time':>9} {'busbw':>7} {'#wrong':>7} {'ratio':>6}"


def timing_line(blocking: bool, iters: int) -> str:
    """What the time columns hold, for the table header."""
    if blocking:
        return (f"timing: blocking (-z 1): time = median of {iters} collectives, each submitted on every rank "
                "and waited for on every rank (p90 in the JSON); /floor = time / host doorbell floor")
    return (f"timing: back to back (-z 0): time = {iters} submissions and one wait at the end, "
            "divided by the iterations; /floor = time / stream doorbell floor")


def format_table_header(kind: str, nccl_line: str, timing: str | None = None) -> str:
    """The column header of one collective's table; ``timing`` (see
    :func:`timing_line`) says which timing the time columns hold."""
    width_head, width_df = len(_HEAD_COLS), len(_DF_COLS)
    groups = (f"#{'':{width_head - 1}}  {'out-of-place':^{width_df}}  {'in-place':^{width_df}}  "
              f"{'NCCL (in place)':^{len(_NCCL_COLS)}}")
    df_units = f"{'(us)':>9} {'':>7} {'(GB/s)':>7} {'(GB/s)':>7} {'':>7}"
    units = (f"#{'(B)':>11} {'(elements)':>12} {'':>9} {'':>6} {'':>5}  {df_units}  {df_units}  "
             f"{'(us)':>9} {'(GB/s)':>7}")
    lines = [f"# collective {kind}", f"# {nccl_line}"] + ([f"# {timing}"] if timing else [])
    return "\n".join(lines + [groups, f"#{_HEAD_COLS[1:]}  {_DF_COLS}  {_DF_COLS}  {_NCCL_COLS}", units])


def _fmt_wrong(w: int | None) -> str:
    return "N/A" if w is None else str(w)


def format_row(row: dict) -> str:
    def lib(d: dict) -> str:
        return (f"{d['time_us']:9.2f} {format_ratio(d.get('floor_ratio')):>7} {d['algbw']:7.2f} {d['busbw']:7.2f} "
                f"{_fmt_wrong(d['wrong']):>7}")

    line = (f"{row['size']:12d} {row['count']:12d} {row['type']:>9} {row['redop']:>6} {row['root']:5d}  "
            f"{lib(row['out_of_place'])}  {lib(row['in_place'])}  ")
    nccl = row.get("nccl")
    if nccl is None:
        return line + f"{'n/a':>9} {'n/a':>7} {'n/a':>7} {'n/a':>6}"
    return line + f"{nccl['time_us']:9.2f} {nccl['busbw']:7.2f} {_fmt_wrong(nccl['wrong']):>7} {row['ratio']:6.2f}"


class ReportError(ValueError):
    """A JSON document that is not a ``dfccl bench`` result."""


def _human_size(n: int) -> str:
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m} {unit}"
    return f"{n} B"


def _capitalised(text: str) -> str:
    return text[:1].upper() + text[1:]


def format_markdown(doc: dict) -> str:
    """Markdown tables of a result JSON written by :func:`run_bench`: a line
    on the run, then one table per collective.  Blocking results show the
    median with the 90th percentile in parentheses.  ReportError when
    ``doc`` is not such a result."""
    try:
        return _markdown(doc)
    except (KeyError, TypeError, IndexError) as exc:
        raise ReportError(f"not a dfccl bench result (missing or malformed {exc})") from None


def _markdown(doc: dict) -> str:
    cfg, rows = doc["config"], doc["rows"]
    blocking = bool(doc.get("timing", {}).get("blocking", False))  # results from before -z have no "timing"
    versions = doc.get("versions", {})
    df, nccl_info = doc.get("dfccl", {}), doc.get("nccl", {})
    gpus = doc.get("gpus") or []
    status = nccl_info.get("status", "measured")
    nccl_state = (f"NCCL {versions.get('nccl', '?')}, {nccl_info.get('form', 'in place')}" if status == "measured"
                  else nccl_unavailable_line(status))
    out = [f"## dfccl bench: {len(gpus)} x {gpus[0] if gpus else '?'}, {doc['mode']} mode, "
           f"{'blocking (-z 1)' if blocking else 'back to back (-z 0)'}", "",
           f"{doc.get('date', '?')} on {doc.get('host', '?')}; dfccl {versions.get('dfccl', '?')} "
           f"(path {df.get('path')}, {df.get('channels')} channels); {nccl_state}; {cfg['dtype']} {cfg['op']}; "
           f"{cfg['iters']} iterations after {cfg['warmup']} warm-up.",
           "Time: median of one collective waited for on every rank (90th percentile in parentheses)."
           if blocking else "Time: back-to-back collectives, loop time divided by the iterations.",
           f"{_capitalised(format_floor_line(doc.get('floor')))}.",
           f"/ floor: dfccl's time over the {'host' if blocking else 'stream'} doorbell floor (1: at the floor).",
           "NCCL / dfccl: NCCL time over dfccl's in-place time (above 1: dfccl faster).", ""]

    def cell(d: dict | None) -> str:
        if d is None:
            return "n/a"
        p90 = f" ({d['p90_us']:.1f})" if "p90_us" in d else ""
        return f"{d['time_us']:.1f}{p90}"

    def bw(d: dict | None) -> str:
        return "n/a" if d is None else f"{d['busbw']:.2f}"

    def over_floor(d: dict) -> str:
        return format_ratio(d.get("floor_ratio"))  # results from before the floor have none

    kinds = [k for k in KINDS if any(r["kind"] == k for r in rows)]
    kinds += sorted({r["kind"] for r in rows} - set(kinds))
    for kind in kinds:
        out += [f"### {kind}", "",
                "| size | count | type | redop | root | out of place (us) | / floor | busbw (GB/s) | in place (us) | "
                "/ floor | busbw (GB/s) | NCCL in place (us) | NCCL busbw (GB/s) | NCCL / dfccl | #wrong |",
                "|---:|---:|:--|:--|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            if r["kind"] != kind:
                continue
            parts = [r["out_of_place"], r["in_place"]] + ([r["nccl"]] if r.get("nccl") else [])
            wrongs = [p["wrong"] for p in parts]
            wrong = "N/A" if any(w is None for w in wrongs) else str(sum(wrongs))
            ratio = "n/a" if r.get("ratio") is None else f"{r['ratio']:.2f}"
            oop, ip = r["out_of_place"], r["in_place"]
            out.append(f"| {_human_size(r['size'])} | {r['count']} | {r['type']} | {r['redop']} | {r['root']} | "
                       f"{cell(oop)} | {over_floor(oop)} | {bw(oop)} | {cell(ip)} | {over_floor(ip)} | {bw(ip)} | "
                       f"{cell(r.get('nccl'))} | {bw(r.get('nccl'))} | {ratio} | {wrong} |")
        out.append("")
    return "\n".join(out)


def finish_row(kind: str, case: Case, measured: dict, floor_us: float | None = None) -> dict:
    """A table row; ``floor_us`` (the floor of this timing, or None) gives
    each dfccl form its ``floor_ratio``."""
    def with_bw(d: dict) -> dict:
        algbw = case.nbytes / (d["time_us"] * 1e-6) / 1e9
        return {**d, "algbw": algbw, "busbw": algbw * bus_factor(kind, case.n)}

    def dfccl_form(d: dict) -> dict:
        return {**with_bw(d), "floor_ratio": floor_ratio(d["time_us"], floor_us)}

    row = {"kind": kind, "size": case.nbytes, "count": case.total_count, "type": case.dtype, "redop": case.redop,
           "root": case.root, "out_of_place": dfccl_form(measured["oop"]), "in_place": dfccl_form(measured["ip"]),
           "nccl": None, "ratio": None}
    if measured.get("nccl") is not None:
        row["nccl"] = with_bw(measured["nccl"])
        row["ratio"] = row["nccl"]["time_us"] / row["in_place"]["time_us"]
    return row


def plot_title(rows: list[dict], *, ranks: int, gpu: str, mode: str, dtype: str, blocking: bool) -> str:
    """The plot's title, naming what ran: NCCL only where some size of it
    was measured."""
    ran = "dfccl vs NCCL" if any(r.get("nccl") for r in rows) else "dfccl"
    timing = "blocking: median of one collective waited for" if blocking else "back to back"
    return f"{ran}, {ranks} x {gpu} ({mode} mode, {dtype}, {timing})"


def write_plot(path: str, rows: list[dict], title: str, floor_us: float | None = None) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig = plot_figure(plt, rows, title, floor_us)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_figure(plt, rows: list[dict], title: str, floor_us: float | None = None):
    kinds = [k for k in KINDS if any(r["kind"] == k for r in rows)]
    # Constrained layout makes room for the figure title above the panels
    # (tight_layout lets a tall figure's title run into its first row).
    fig, axes = plt.subplots(len(kinds), 2, figsize=(11, 3.6 * len(kinds)), squeeze=False, layout="constrained")
    for i, kind in enumerate(kinds):
        rs = [r for r in rows if r["kind"] == kind]
        sizes = [r["size"] for r in rs]
        series = [("dfccl out of place", "out_of_place", "-o"), ("dfccl in place", "in_place", "-s"),
                  ("NCCL (in place)", "nccl", "--^")]
        for label, key, style in series:
            pts = [(s, r[key]) for s, r in zip(sizes, rs) if r.get(key) is not None]
            if not pts:
                continue
            xs = [p[0] for p in pts]
            axes[i][0].plot(xs, [p[1]["time_us"] for p in pts], style, label=label, markersize=4)
            axes[i][1].plot(xs, [p[1]["busbw"] for p in pts], style, label=label, markersize=4)
        if floor_us is not None:
            axes[i][0].axhline(floor_us, color="gray", linestyle=":", label=f"floor ({floor_us:.1f} us)")
        for j, ylabel in enumerate(("latency (us)", "busbw (GB/s)")):
            ax = axes[i][j]
            ax.set_xscale("log", base=2)
            if j == 0:
                ax.set_yscale("log")
            ax.set_xlabel("size (bytes)")
            ax.set_ylabel(ylabel)
            ax.set_title(kind)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(title, wrap=True)
    return fig


def nccl_unavailable_line(status: str) -> str:
    return f"NCCL: {status}" if status.startswith("disabled") else f"NCCL: not available ({status})"
