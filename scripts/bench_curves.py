#!/usr/bin/env python3
"""bench_curves.py: the Python half of scripts/bench-curves.sh.

  bench_curves.py DIR

reads DIR/raw.txt (the test binary's benchmark lines, every round), takes
each point's median over the rounds, normalizes each cost-growth curve of
issue 19 to its first point, prints a table per curve (and writes them to
DIR/curves.md) and one SVG plot per curve, DIR/curve-NAME.svg: log x axis,
cost ratio on the y axis (log too where the curve spans more than 4x),
the issue's target, 1.2x, as a dashed line.

Standard library only.
"""
import math
import os
import re
import statistics
import sys

COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
TARGET = 1.2

# Each curve: its name, title, x axis label, its series (a label, a regular
# expression over the benchmark name whose group is x, the metric), and
# optionally ref, a second x to normalize to beside the first point (the
# issue's usual setting where the curve's first point is not it).
CURVES = [
    dict(name="buffers", title="Per-request cost against registered buffers (to the last buffer)",
         xlabel="buffers registered at the target", unit="ns/request",
         series=[("caller waits (ScaleBuffersWaiting)", r"BenchmarkScaleBuffersWaiting/buffers=(\d+)$", "ns/op"),
                 ("caller spins (ScaleBuffers)", r"BenchmarkScaleBuffers/buffers=(\d+)/to=last$", "ns/op")]),
    dict(name="segments", title="Per-request cost against open segments (BenchmarkScaleSegments)",
         xlabel="segments open at the initiator", unit="ns/request",
         series=[("to the last opened", r"BenchmarkScaleSegments/segments=(\d+)$", "ns/op")],
         extra=[("ms to open all", "ms-open-all"), ("µs/open, last tenth", "µs/open-last10%"),
                ("KiB heap/target", "KiB-heap/target"), ("goroutines/target", "goroutines/target")]),
    dict(name="peers", title="Per-request cost against distinct peers over loopback TCP (BenchmarkScalePeers)",
         xlabel="peer engines", unit="ns/request",
         series=[("moonring (ScalePeers)", r"BenchmarkScalePeers/peers=(\d+)$", "ns/op"),
                 ("raw TCP pairs (ScalePeersRaw)", r"BenchmarkScalePeersRaw/peers=(\d+)$", "ns/op")]),
    dict(name="peers-turn", title="Per-request cost against peers connected, each round on one peer in turn (BenchmarkScalePeersTurn)",
         xlabel="peer engines", unit="ns/request",
         series=[("moonring (ScalePeersTurn)", r"BenchmarkScalePeersTurn/peers=(\d+)$", "ns/op"),
                 ("raw TCP pairs (ScalePeersTurnRaw)", r"BenchmarkScalePeersTurnRaw/peers=(\d+)$", "ns/op")]),
    dict(name="peers-apart", title="Per-request cost against peers, the target in a process of its own (BenchmarkScalePeersApart)",
         xlabel="peer engines", unit="ns/request",
         series=[("target's CPU (tgt-cpu-ns/op)", r"BenchmarkScalePeersApart/peers=(\d+)$", "tgt-cpu-ns/op"),
                 ("peers' CPU (own-cpu-ns/op)", r"BenchmarkScalePeersApart/peers=(\d+)$", "own-cpu-ns/op"),
                 ("wall time (ns/op)", r"BenchmarkScalePeersApart/peers=(\d+)$", "ns/op"),
                 ("raw far end's CPU (ScalePeersApartRaw)", r"BenchmarkScalePeersApartRaw/peers=(\d+)$", "tgt-cpu-ns/op")]),
    dict(name="peers-procs", title="Per-request cost against peers spread over up to 4 processes, the target in one of its own (BenchmarkScalePeersProcs)",
         xlabel="peer engines", unit="ns/request",
         series=[("target's CPU (tgt-cpu-ns/op)", r"BenchmarkScalePeersProcs/peers=(\d+)$", "tgt-cpu-ns/op"),
                 ("peers' processes' CPU (peers-cpu-ns/op)", r"BenchmarkScalePeersProcs/peers=(\d+)$", "peers-cpu-ns/op"),
                 ("wall time (ns/op)", r"BenchmarkScalePeersProcs/peers=(\d+)$", "ns/op")]),
    dict(name="depth", title="Per-request cost against requests in flight (BenchmarkScaleDepth)",
         xlabel="requests in flight", unit="ns/request", ref=64,
         series=[("4 KiB WRITEs", r"BenchmarkScaleDepth/depth=(\d+)$", "ns/op")],
         extra=[("req/s", "req/s")]),
    dict(name="batch", title="Per-task cost against batch size (BenchmarkScaleBatch)",
         xlabel="tasks in one batch", unit="ns/task", ref=32, allocs="allocs/task",
         series=[("4 KiB WRITE tasks", r"BenchmarkScaleBatch/tasks=(\d+)$", "ns/task")]),
    dict(name="churn", title="Register/unregister cycle against buffers held (BenchmarkScaleChurn, CPU time, last 1,000 cycles)",
         xlabel="buffers registered beside the churned one", unit="CPU µs/cycle", allocs=None,
         series=[("local-only", r"BenchmarkScaleChurn/buffers=(\d+)/local$", "cpu-µs/cycle-last1k"),
                 ("remote-accessible", r"BenchmarkScaleChurn/buffers=(\d+)/remote$", "cpu-µs/cycle-last1k")],
         extra=[("cpu µs first 1k", "cpu-µs/cycle-first1k"), ("wall µs first 1k", "µs/cycle-first1k"),
                ("wall µs last 1k", "µs/cycle-last1k"), ("MiB heap start", "MiB-heap-start"),
                ("MiB heap end", "MiB-heap-end"), ("cycles", "cycles")]),
]

LINE = re.compile(r"^(Benchmark\S+?)(?:-\d+)?\s+(\d+)\s+(.*)$")


def parse(path):
    """{name: {unit: [value per round]}}"""
    out = {}
    with open(path) as f:
        for line in f:
            m = LINE.match(line.strip())
            if not m:
                continue
            fields = m.group(3).split()
            d = out.setdefault(m.group(1), {})
            for v, u in zip(fields[0::2], fields[1::2]):
                try:
                    d.setdefault(u, []).append(float(v))
                except ValueError:
                    pass
    return out


def fmt(v):
    if v is None:
        return "-"
    if v >= 100:
        return "{:,.0f}".format(v)
    if v >= 10:
        return "%.1f" % v
    if v >= 1:
        return "%.2f" % v
    return "%.3g" % v


def xfmt(x):
    for div, suf in ((1 << 20, "Mi"), (1000, "k")):
        if x >= div and x % div == 0:
            return "%d%s" % (x // div, suf)
    if x == 65536:
        return "64Ki"
    return str(x)


def points(runs, regex, metric):
    """[(x, median, min, max, rounds)] sorted by x."""
    pts = []
    rx = re.compile(regex)
    for name, d in runs.items():
        m = rx.match(name)
        if m and metric in d:
            vs = d[metric]
            pts.append((int(m.group(1)), statistics.median(vs), min(vs), max(vs), len(vs), name))
    return sorted(pts)


def med(runs, name, unit):
    vs = runs.get(name, {}).get(unit)
    return statistics.median(vs) if vs else None


def curve_table(c, runs):
    head = ["series", "x", c["unit"] + " (median)", "range", "ratio to first"]
    ref = c.get("ref")
    if ref:
        head.append("ratio to %s" % xfmt(ref))
    allocs = c.get("allocs", "allocs/op")
    if allocs:
        head.append(allocs)
    for label, _ in c.get("extra", []):
        head.append(label)
    rows, plot = [], []
    for label, regex, metric in c["series"]:
        pts = points(runs, regex, metric)
        if not pts:
            continue
        first = pts[0][1]
        refv = next((p[1] for p in pts if p[0] == ref), None) if ref else None
        ser = [(label + " ÷ " + xfmt(pts[0][0]), [(p[0], p[1] / first) for p in pts])]
        if refv:
            ser.append((label + " ÷ " + xfmt(ref), [(p[0], p[1] / refv) for p in pts]))
        plot += ser
        for x, v, lo, hi, n, name in pts:
            row = [label, xfmt(x), fmt(v), "%s-%s (%d)" % (fmt(lo), fmt(hi), n), "%.2fx" % (v / first)]
            if ref:
                row.append("%.2fx" % (v / refv) if refv else "-")
            if allocs:
                row.append(fmt(med(runs, name, allocs)))
            for _, unit in c.get("extra", []):
                row.append(fmt(med(runs, name, unit)))
            rows.append(row)
    return head, rows, plot


def markdown(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def esc(s):
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def svg_curve(path, title, xlabel, series):
    """series: [(name, [(x, ratio)])]; log x, the target as a dashed line."""
    W, H, L, R, T, B = 760, 310, 60, 230, 34, 50
    xs = [x for _, pts in series for x, _ in pts]
    ys = [y for _, pts in series for _, y in pts] + [1.0, TARGET]
    x0, x1 = math.log10(max(1, min(xs))), math.log10(max(xs))
    if x1 - x0 < 1e-9:
        x1 = x0 + 1
    lo, hi = min(ys), max(ys)
    logy = hi / lo > 4
    if logy:
        y0, y1 = math.log10(lo) - 0.08, math.log10(hi) + 0.08
        fy = math.log10
    else:
        step = next(st for st in (0.1, 0.2, 0.25, 0.5, 1, 2, 2.5, 5, 10, 20, 50, 100) if hi * 1.1 / st <= 6)
        y0, y1 = 0.0, math.ceil(hi * 1.1 / step) * step
        fy = float
    pw, ph = W - L - R, H - T - B
    px = lambda x: L + (math.log10(max(1, x)) - x0) / (x1 - x0) * pw  # noqa: E731
    py = lambda v: T + ph - (fy(v) - y0) / (y1 - y0) * ph  # noqa: E731
    o = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="11">' % (W, H),
         '<rect width="100%" height="100%" fill="white"/>',
         '<text x="%d" y="18" font-size="13">%s</text>' % (10, esc(title)),
         '<rect x="%d" y="%d" width="%d" height="%d" fill="none" stroke="black"/>' % (L, T, pw, ph)]
    # y grid
    if logy:
        ticks = [10 ** e * m for e in range(math.floor(y0) - 1, math.ceil(y1) + 1) for m in (1, 2, 3, 5)]
        ticks = [t for t in ticks if y0 <= math.log10(t) <= y1]
    else:
        ticks = [step * i for i in range(round(y1 / step) + 1)]
    for t in ticks:
        o.append('<line x1="%d" x2="%d" y1="%.1f" y2="%.1f" stroke="#ddd"/>' % (L, L + pw, py(t), py(t)))
        o.append('<text x="%d" y="%.1f" text-anchor="end">%.3gx</text>' % (L - 4, py(t) + 4, t))
    # x ticks: each decade, and the curve's own points
    for e in range(math.floor(x0), math.ceil(x1) + 1):
        x = 10 ** e
        if x0 - 1e-9 <= e <= x1 + 1e-9:
            o.append('<line x1="%.1f" x2="%.1f" y1="%d" y2="%d" stroke="#eee"/>' % (px(x), px(x), T, T + ph))
    last = -1e9
    for x in sorted(set(xs)):
        crowded = px(x) - last < 30  # a second line for a label too close to the last one
        o.append('<text x="%.1f" y="%d" text-anchor="middle">%s</text>' % (px(x), T + ph + (25 if crowded else 14), xfmt(x)))
        last = -1e9 if crowded else px(x)
    o.append('<text x="%d" y="%d" text-anchor="middle">%s (log scale)</text>' % (L + pw // 2, H - 6, esc(xlabel)))
    o.append('<text transform="translate(14,%d) rotate(-90)" text-anchor="middle">cost ratio%s</text>' % (T + ph // 2, " (log scale)" if logy else ""))
    # the target
    o.append('<line x1="%d" x2="%d" y1="%.1f" y2="%.1f" stroke="#990000" stroke-dasharray="6,4"/>' % (L, L + pw, py(TARGET), py(TARGET)))
    o.append('<text x="%d" y="%.1f" fill="#990000">target 1.2x</text>' % (L + pw + 8, py(TARGET) + 4))
    o.append('<line x1="%d" x2="%d" y1="%.1f" y2="%.1f" stroke="#999"/>' % (L, L + pw, py(1), py(1)))
    for i, (name, pts) in enumerate(series):
        c = COLORS[i % len(COLORS)]
        o.append('<polyline fill="none" stroke="%s" stroke-width="1.5" points="%s"/>' % (c, " ".join("%.1f,%.1f" % (px(x), py(v)) for x, v in pts)))
        for x, v in pts:
            o.append('<circle cx="%.1f" cy="%.1f" r="3" fill="%s"><title>%s: %.3gx</title></circle>' % (px(x), py(v), c, xfmt(x), v))
        o.append('<text x="%d" y="%d" fill="%s">%s</text>' % (L + pw + 8, T + 14 + 14 * i, c, esc(name)))
    o.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(o) + "\n")


def main(d):
    runs = parse(os.path.join(d, "raw.txt"))
    md = []
    for c in CURVES:
        head, rows, plot = curve_table(c, runs)
        if not rows:
            continue
        svg = os.path.join(d, "curve-%s.svg" % c["name"])
        svg_curve(svg, c["title"], c["xlabel"], plot)
        text = "### %s\n\n%s\n\nPlot: %s\n" % (c["title"], markdown(head, rows), svg)
        print(text)
        md.append(text)
    with open(os.path.join(d, "curves.md"), "w") as f:
        f.write("\n".join(md))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
