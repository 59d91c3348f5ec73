#!/usr/bin/env python3
"""cluster_lib.py: the Python half of scripts/cluster.sh and scripts/soak.sh.

  wait-http URL SECONDS [SUBSTRING]   until URL answers 200 (with SUBSTRING)
  etcd-leader URL...                  the index of the member that leads
  sample RUN INTERVAL                 scrape RUN/scrape.tsv's /metrics and
                                      RUN/procs.tsv's /proc until RUN/stop
  wait-recovered RUN PHASE SECONDS    until every initiator moves bytes again
  analyze RUN                         cluster.sh's tables, plot and checks
  soak RUN                            soak.sh's tables, plot and checks

Standard library only.
"""
import json
import math
import os
import re
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

NOPROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def fetch(url, timeout=1.0):
    with NOPROXY.open(url, timeout=timeout) as r:
        return r.status, r.read().decode("utf-8", "replace")


def wait_http(url, secs, want=""):
    end = time.time() + float(secs)
    last = ""
    while time.time() < end:
        try:
            st, body = fetch(url)
            if st == 200 and want in body:
                return 0
            last = "%d %s" % (st, body[:200])
        except Exception as e:  # noqa: BLE001 - anything means "not yet"
            last = str(e)
        time.sleep(0.1)
    print("wait-http %s: not ready after %ss: %s" % (url, secs, last), file=sys.stderr)
    return 1


def etcd_leader(urls):
    for k, u in enumerate(urls):
        try:
            _, body = fetch(u + "/metrics")
        except Exception:  # noqa: BLE001
            continue
        if re.search(r"^etcd_server_is_leader 1$", body, re.M):
            print(k)
            return 0
    print("none")
    return 1


# --- sampling ---------------------------------------------------------------

LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([^ ]+)')
LABEL = re.compile(r'(\w+)="([^"]*)"')


def parse_metrics(text):
    """The figures the checks need from a serve's /metrics."""
    out = {"bytes_by_peer": {}, "req_by_status": {}, "gor": None, "fds": None, "rss": None}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = LINE.match(line)
        if not m:
            continue
        name, labels, val = m.group(1), m.group(2) or "", m.group(3)
        try:
            v = float(val)
        except ValueError:
            continue
        if name == "moonring_served_bytes_total":
            lab = dict(LABEL.findall(labels))
            peer = lab.get("peer", "?").rsplit(":", 1)[0].strip("[]")
            out["bytes_by_peer"][peer] = out["bytes_by_peer"].get(peer, 0) + v
        elif name == "moonring_served_requests_total":
            lab = dict(LABEL.findall(labels))
            st = lab.get("status", "?")
            out["req_by_status"][st] = out["req_by_status"].get(st, 0) + v
        elif name == "go_goroutines":
            out["gor"] = v
        elif name == "process_open_fds":
            out["fds"] = v
        elif name == "process_resident_memory_bytes":
            out["rss"] = v
    return out


def proc_stats(pid):
    try:
        with open("/proc/%d/status" % pid) as f:
            st = f.read()
        rss = int(re.search(r"VmRSS:\s+(\d+)", st).group(1)) * 1024
        thr = int(re.search(r"Threads:\s+(\d+)", st).group(1))
        fds = len(os.listdir("/proc/%d/fd" % pid))
        return {"pid": pid, "rss": rss, "fds": fds, "threads": thr}
    except Exception:  # noqa: BLE001 - gone
        return None


def read_tsv(path):
    out = {}
    try:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2:
                    out[parts[0]] = parts[1]
    except FileNotFoundError:
        pass
    return out


def sample(run, interval):
    interval = float(interval)
    out = open(os.path.join(run, "samples.jsonl"), "a")
    pool = ThreadPoolExecutor(8)

    def one(item):
        label, url = item
        try:
            st, body = fetch(url, timeout=max(0.4, interval))
            if st != 200:
                return label, None
            return label, parse_metrics(body)
        except Exception:  # noqa: BLE001 - down
            return label, None

    stop_seen = None
    while True:
        t = time.time()
        scrape = read_tsv(os.path.join(run, "scrape.tsv"))
        procs = read_tsv(os.path.join(run, "procs.tsv"))
        m = dict(pool.map(one, scrape.items()))
        p = {label: proc_stats(int(pid)) for label, pid in procs.items()}
        out.write(json.dumps({"t": t, "m": m, "p": p}) + "\n")
        out.flush()
        if os.path.exists(os.path.join(run, "stop")):
            if stop_seen is None:
                stop_seen = time.time()
            elif time.time() - stop_seen > 1:
                return 0
        time.sleep(max(0.0, interval - (time.time() - t)))


def load_jsonl(path):
    out = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        pass  # a line cut by a kill
    except FileNotFoundError:
        pass
    return out


# --- throughput -------------------------------------------------------------


def host_of_ip(ip):
    try:
        return int(ip.rsplit(".", 1)[1]) - 10
    except (ValueError, IndexError):
        return None


def byte_deltas(samples):
    """[(t, host, bytes)] moved by each initiator host between samples, from
    the serves' served-bytes counters (a restarted serve's start from 0)."""
    last = {}
    out = []
    for s in samples:
        for label, m in (s.get("m") or {}).items():
            if not m:
                continue
            for peer, v in m["bytes_by_peer"].items():
                k = (label, peer)
                prev = last.get(k)
                d = v - prev if prev is not None and v >= prev else (v if prev is not None else 0)
                last[k] = v
                h = host_of_ip(peer)
                if d > 0 and h is not None:
                    out.append((s["t"], h, d))
    return out


def bytes_in(deltas, a, b, hosts=None):
    return sum(d for t, h, d in deltas if a < t <= b and (hosts is None or h in hosts))


def rate(deltas, a, b, hosts=None):
    return bytes_in(deltas, a, b, hosts) / max(1e-9, b - a)


def median_rate(deltas, a, b, host, step=1.0):
    rs = []
    t = a
    while t + step <= b + 1e-9:
        rs.append(rate(deltas, t, t + step, {host}))
        t += step
    return statistics.median(rs) if rs else 0.0


def phases_of(events):
    setup = next((e for e in events if e["ev"] == "setup"), {})
    ph = []
    for e in events:
        if e["ev"] == "phase":
            ph.append({"name": e["phase"], "start": e["t"]})
        elif e["ev"] in ("fault", "heal") and ph:
            ph[-1][e["ev"]] = e["t"]
            ph[-1][e["ev"] + "_ev"] = e
        elif e["ev"] == "end" and ph:
            ph[-1]["end"] = e["t"]
    for k in range(len(ph) - 1):
        ph[k]["end"] = ph[k + 1]["start"]
    return setup, ph


PRE = 6.0  # seconds before a fault that give each initiator's reference rate
WIN = 2.0  # a recovered initiator moves 30% of its reference rate over WIN


def recovery(deltas, ph, hosts, now):
    """Seconds from the heal until every host moved RECOVER_SHARE of its
    pre-fault rate over WIN seconds; None if not yet."""
    fault, heal = ph["fault"], ph["heal"]
    worst = 0.0
    for h in hosts:
        ref = median_rate(deltas, fault - PRE, fault, h)
        if ref <= 0:
            continue  # it moved nothing before the fault: nothing to recover
        t = heal
        found = None
        while t + WIN <= now:
            if rate(deltas, t, t + WIN, {h}) >= 0.3 * ref:
                found = t - heal
                break
            t += 0.5
        if found is None:
            return None
        worst = max(worst, found)
    return worst


def wait_recovered(run, phase, secs):
    end = time.time() + float(secs)
    while True:
        events = load_jsonl(os.path.join(run, "events.jsonl"))
        setup, phs = phases_of(events)
        ph = next((p for p in phs if p["name"] == phase and "heal" in p), None)
        if ph is None:
            print("wait-recovered %s: no heal event" % phase, file=sys.stderr)
            return 1
        deltas = byte_deltas(load_jsonl(os.path.join(run, "samples.jsonl")))
        r = recovery(deltas, ph, range(setup["hosts"]), time.time())
        if r is not None:
            print("wait-recovered %s: %.1fs" % (phase, r), file=sys.stderr)
            return 0
        if time.time() > end:
            print("wait-recovered %s: not recovered after %ss" % (phase, secs), file=sys.stderr)
            return 1
        time.sleep(1)


# --- bench runs -------------------------------------------------------------

STATUS = re.compile(r"\b(COMPLETED|FAILED|TIMEOUT|CANCELED|PENDING|WAITING)\b")
CORRUPT = re.compile(r"does not hold|stamp|mismatch|corrupt", re.I)
CRASH = re.compile(r"^(fatal error:|panic:|SIGSEGV|unexpected fault address)", re.M)
OPEN = re.compile(r"open segment|no transport for segment|segment not found|get \"", re.I)
METADATA = re.compile(r"etcd|metadata|unavailable|leader|no such segment|not found|deadline", re.I)


def read_rows(path):
    try:
        text = open(path).read()
    except FileNotFoundError:
        return []
    text = text.strip()
    if not text:
        return []
    try:
        v = json.loads(text)
        return v if isinstance(v, list) else [v]
    except ValueError:
        rows = []
        for line in text.splitlines():
            line = line.strip().rstrip(",").lstrip("[").rstrip("]")
            if line.startswith("{"):
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    pass
        return rows


TERMINAL = ("completed", "failed", "timeout", "canceled")


def row_counts(row):
    """A bench row's requests by how they ended (its "statuses"), or None
    for a row of a bench that does not count them."""
    st = row.get("statuses")
    return st if isinstance(st, dict) and "submitted" in st else None


def lost_requests(rows):
    """What breaks "every request ends in exactly one terminal status" in
    a run's rows: a row whose terminal counts do not add up to its
    submitted requests, or whose FAILED ones by code do not add up to
    FAILED."""
    bad = []
    for k, row in enumerate(rows):
        st = row_counts(row)
        if st is None:
            continue
        ended = sum(st.get(x, 0) for x in TERMINAL)
        if ended != st["submitted"]:
            bad.append("row %d (%s %s): %d requests submitted, %d ended" % (k, row.get("op"), row.get("pattern") or row.get("block"), st["submitted"], ended))
        by = sum((st.get("failed_by_code") or {}).values())
        if by != st.get("failed", 0):
            bad.append("row %d (%s %s): %d FAILED, %d by code" % (k, row.get("op"), row.get("pattern") or row.get("block"), st.get("failed", 0), by))
    return bad


def request_statuses(rows):
    """{status or FAILED/code: count} of the requests of rows that did not
    complete, from their counts."""
    out = {}
    for row in rows:
        st = row_counts(row)
        if st is None:
            continue
        for code, n in (st.get("failed_by_code") or {}).items():
            out["FAILED/" + code] = out.get("FAILED/" + code, 0) + n
        for x in ("timeout", "canceled"):
            if st.get(x):
                out[x.upper()] = out.get(x.upper(), 0) + st[x]
    return out


def classify(run_rec, phs, grace=2.0):
    """ok, expected (a fault touched it), unexpected, hang, corrupt, crash,
    or lost (its rows' counts say a request did not end in exactly one
    terminal status)."""
    rc = run_rec["rc"]
    base = run_rec["file"]
    rows = read_rows(base + ".json")
    try:
        err = open(base + ".err").read()
    except FileNotFoundError:
        err = ""
    run_rec["rows"] = rows
    lines = [l for l in err.splitlines() if l.strip()]
    crash = [l for l in lines if CRASH.match(l)]
    if crash:
        # The fatal error and the first frame of this module's code.
        frame = next((l.strip() for l in lines if l.startswith("main.") or "moonring/moonring" in l and not l.startswith("\t")), "")
        run_rec["err"] = "; ".join(crash[:2] + ([frame] if frame else []))
    else:
        run_rec["err"] = lines[-1] if lines else ""
    run_rec["statuses"] = sorted(set(STATUS.findall(err))) or (["open"] if OPEN.search(err) else ["metadata"] if METADATA.search(err) else [])
    # bench --keep-going prints the row of the step that failed: its
    # counts say how its requests ended.
    counted = request_statuses(rows)
    if counted:
        run_rec["statuses"] = sorted(set(k.split("/")[0] for k in counted))
    run_rec["lost"] = lost_requests(rows)
    if crash:
        run_rec["statuses"] = ["crash"]
        return "crash"
    if run_rec["lost"]:
        run_rec["err"] = "; ".join(run_rec["lost"])
        return "lost"
    if any(r.get("verified") is False for r in rows):
        return "corrupt"
    if CORRUPT.search(err):
        return "corrupt"
    if rc == 0:
        return "ok" if rows and all(r.get("verified") for r in rows) else "unexpected"
    if rc in (124, 137):
        return "hang"
    for ph in phs:
        if "fault" not in ph:
            continue
        a, b = ph["fault"], ph.get("heal", ph["fault"]) + grace
        if run_rec["t0"] > b or run_rec["t1"] < a:
            continue
        aff = ph["fault_ev"].get("affected", [])
        if run_rec["host"] in aff:
            return "expected"
        if ph["name"] == "etcd" and METADATA.search(err):
            return "expected"
    return "unexpected"


# --- growth -----------------------------------------------------------------

# A long-lived process grows when, at the end of the last phase (or the last
# third of a soak), a figure exceeds the first's by more than this share
# plus this slack.
GROWTH = {"gor": (1.25, 16), "fds": (1.25, 16), "rss": (1.25, 64 << 20)}


def figures(s, label):
    m = (s.get("m") or {}).get(label)
    p = (s.get("p") or {}).get(label)
    out = {}
    if m:
        out["gor"] = m.get("gor")
    if p:
        out["fds"], out["rss"], out["pid"] = p["fds"], p["rss"], p["pid"]
    elif m:
        out["fds"], out["rss"] = m.get("fds"), m.get("rss")
    return out


def median_fig(samples, label, key, a, b):
    vs = [figures(s, label).get(key) for s in samples if a <= s["t"] <= b]
    vs = [v for v in vs if v is not None]
    return statistics.median(vs) if vs else None


def long_lived(samples, prefix):
    """Labels whose process kept one pid throughout."""
    pids = {}
    for s in samples:
        for label, p in (s.get("p") or {}).items():
            if label.startswith(prefix) and p:
                pids.setdefault(label, set()).add(p["pid"])
    return sorted(l for l, ps in pids.items() if len(ps) == 1)


def growth_check(first, last, label, what):
    bad = []
    for key, (share, slack) in GROWTH.items():
        a, b = first.get(key), last.get(key)
        if a is None or b is None:
            continue
        if b > a * share + slack:
            bad.append("%s %s: %s grew from %s to %s (rule: at most %.2fx + %s)" % (what, label, key, fmtv(key, a), fmtv(key, b), share, fmtv(key, slack)))
    return bad


def fmtv(key, v):
    if v is None:
        return "-"
    if key == "rss":
        return "%.0fMiB" % (v / (1 << 20))
    return "%d" % v


# --- plot -------------------------------------------------------------------

COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]


def svg_plot(path, title, t0, t1, panels, bands):
    """panels: [(ylabel, [(name, [(t, v)])])]; bands: [(a, b, label)]."""
    W, H, L, R, T, B, GAP = 1000, 260, 70, 160, 30, 30, 20
    height = T + len(panels) * (H + GAP) + B
    o = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="11">' % (W, height),
         '<rect width="100%" height="100%" fill="white"/>',
         '<text x="%d" y="18" font-size="14">%s</text>' % (L, esc(title))]
    span = max(1e-9, t1 - t0)
    pw = W - L - R
    for k, (ylabel, series) in enumerate(panels):
        y0 = T + k * (H + GAP)
        vmax = max([v for _, pts in series for t, v in pts if t0 <= t <= t1] + [1e-9]) * 1.1
        x = lambda t: L + (t - t0) / span * pw  # noqa: E731
        y = lambda v: y0 + H - v / vmax * H  # noqa: E731
        for a, b, lab in bands:
            o.append('<rect x="%.1f" y="%d" width="%.1f" height="%d" fill="#f4cccc" opacity="0.6"/>' % (x(a), y0, max(1, x(b) - x(a)), H))
            if k == 0:
                o.append('<text x="%.1f" y="%d" fill="#990000">%s</text>' % (x(a) + 2, y0 + 12, esc(lab)))
        o.append('<rect x="%d" y="%d" width="%d" height="%d" fill="none" stroke="black"/>' % (L, y0, pw, H))
        for i in range(5):
            v = vmax * i / 4
            o.append('<text x="%d" y="%.1f" text-anchor="end">%s</text>' % (L - 4, y(v) + 4, ("%.3g" % v)))
            o.append('<line x1="%d" x2="%d" y1="%.1f" y2="%.1f" stroke="#ddd"/>' % (L, L + pw, y(v), y(v)))
        o.append('<text transform="translate(14,%d) rotate(-90)" text-anchor="middle">%s</text>' % (y0 + H // 2, esc(ylabel)))
        for i, (name, pts) in enumerate(series):
            pts = [(t, v) for t, v in pts if t0 <= t <= t1]
            pts = pts[::max(1, -(-len(pts) // 500))]  # a point a pixel or so is enough
            c = COLORS[i % len(COLORS)]
            if pts:
                o.append('<polyline fill="none" stroke="%s" stroke-width="1.3" points="%s"/>' % (c, " ".join("%.1f,%.1f" % (x(t), y(v)) for t, v in pts)))
            o.append('<text x="%d" y="%d" fill="%s">%s</text>' % (L + pw + 8, y0 + 14 + 13 * i, c, esc(name)))
        for i in range(6):
            t = t0 + span * i / 5
            o.append('<text x="%.1f" y="%d" text-anchor="middle">%ds</text>' % (x(t), y0 + H + 13, t - t0))
    o.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(o))


def esc(s):
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def table(head, rows):
    w = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda r: "  ".join(str(x).ljust(n) for x, n in zip(r, w)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * n for n in w])] + [line(r) for r in rows])


# --- cluster analysis -------------------------------------------------------


def analyze(run):
    events = load_jsonl(os.path.join(run, "events.jsonl"))
    setup, phs = phases_of(events)
    samples = load_jsonl(os.path.join(run, "samples.jsonl"))
    runs = load_jsonl(os.path.join(run, "bench", "runs.jsonl"))
    hosts = setup.get("hosts", 0)
    recover_max = float(setup.get("recover", 10))
    deltas = byte_deltas(samples)
    fail = []
    out = []
    t_end = next((e["t"] for e in events if e["ev"] == "end"), samples[-1]["t"] if samples else 0)

    classes = {}
    for r in runs:
        r["class"] = classify(r, phs)
        classes.setdefault(r["class"], []).append(r)
    for cls in ("hang", "corrupt", "crash", "lost", "unexpected"):
        for r in classes.get(cls, []):
            fail.append("bench run h%d #%d (%s, %.1fs after the start, rc %d): %s: %s" % (
                r["host"], r["seq"], r["segments"], r["t0"] - phs[0]["start"] if phs else 0, r["rc"], cls, r.get("err") or "(no message)"))

    # Target-side requests by status, per phase.
    def served_status(a, b):
        first, last = {}, {}
        for s in samples:
            if not (a <= s["t"] <= b):
                continue
            for label, m in (s.get("m") or {}).items():
                if not m:
                    continue
                for st, v in m["req_by_status"].items():
                    first.setdefault((label, st), v)
                    last[(label, st)] = v
        tot = {}
        for k, v in last.items():
            d = v - first[k]
            if d < 0:
                d = v
            tot[k[1]] = tot.get(k[1], 0) + d
        return tot

    rows = []
    for ph in phs:
        a, b = ph["start"], ph.get("end", t_end)
        in_phase = [r for r in runs if a <= r["t1"] < b]
        cnt = {}
        for r in in_phase:
            cnt[r["class"]] = cnt.get(r["class"], 0) + 1
        st = {}
        for r in in_phase:
            if r["class"] != "ok":
                for s in r["statuses"] or (["hang"] if r["class"] == "hang" else ["(none said)"]):
                    st[s] = st.get(s, 0) + 1
        served = served_status(a, b)
        served_txt = " ".join("%s %d" % (k, v) for k, v in sorted(served.items())) or "-"
        runs_txt = " ".join("%s %d" % (k, cnt[k]) for k in ("ok", "expected", "unexpected", "hang", "corrupt", "crash", "lost") if cnt.get(k))
        # The initiators' requests, from their rows' counts (bench
        # --keep-going prints a failed step's row too).
        rq = {"submitted": 0, "completed": 0}
        for r in in_phase:
            for row in r["rows"]:
                rc = row_counts(row)
                if rc:
                    rq["submitted"] += rc["submitted"]
                    rq["completed"] += rc.get("completed", 0)
        for k, v in request_statuses([row for r in in_phase for row in r["rows"]]).items():
            rq[k] = v
        bench_txt = " ".join("%s %d" % (k, rq[k]) for k in ["submitted", "completed"] + sorted(k for k in rq if k not in ("submitted", "completed"))) if rq["submitted"] else "-"
        fst = " ".join("%s %d" % kv for kv in sorted(st.items())) or "-"
        if "fault" in ph:
            aff = set(ph["fault_ev"].get("affected", []))
            surv = set(range(hosts)) - aff
            before = rate(deltas, ph["fault"] - PRE, ph["fault"], surv) / 1e9
            during = rate(deltas, ph["fault"], ph["heal"], surv) / 1e9 if "heal" in ph else float("nan")
            rec = recovery(deltas, ph, range(hosts), b) if "heal" in ph else None
            if rec is None or rec > recover_max:
                fail.append("phase %s: throughput not back within %.0fs of the heal (every initiator at 30%% of its rate before the fault over %.0fs): %s" % (
                    ph["name"], recover_max, WIN, "never, within the phase" if rec is None else "%.1fs" % rec))
            after = rate(deltas, ph["heal"] + (rec or 0), b, None) / 1e9 if "heal" in ph else float("nan")
            victim = ph["fault_ev"].get("victim")
            what = {"kill": "kill -9 serves of h%s" % victim, "partition": "h%s partitioned" % victim,
                    "netem": "h%s link delay+loss" % victim, "etcd": "etcd leader %s killed" % victim}.get(ph["name"], ph["name"])
            extra = ""
            if ph["name"] == "netem":
                try:
                    n = sum(int(x) for x in re.findall(r"counter packets (\d+)", open(os.path.join(run, "logs", "netem-drops.txt")).read()))
                    extra = " (%d packets dropped)" % n
                except FileNotFoundError:
                    pass
            if ph["name"] == "kill" and "heal_ev" in ph:
                extra = " (restart took %.1fs)" % ph["heal_ev"].get("restart_s", 0)
            rows.append([ph["name"], what + extra, "%.1f" % (ph["heal"] - ph["fault"]) if "heal" in ph else "-",
                         ",".join("h%d" % h for h in sorted(surv)), "%.3f" % before, "%.3f" % during,
                         "%.3f" % after, "-" if rec is None else "%.1f" % rec, runs_txt, fst, bench_txt, served_txt])
        else:
            r_all = rate(deltas, a, b, None) / 1e9
            rows.append([ph["name"], "-", "-", "all", "%.3f" % r_all, "-", "-", "-", runs_txt, fst, bench_txt, served_txt])
    head = ["phase", "fault", "held s", "survivors", "surv GB/s before", "surv GB/s during", "all GB/s after", "recover s",
            "bench runs", "failed runs' status", "bench requests by status", "target-side requests by status"]
    out.append("Per phase (GB/s from the serves' served-bytes counters, by initiator; 'before' is the %.0fs before the fault):" % PRE)
    out.append(table(head, rows))

    # Per initiator: bench runs and verified steps.
    prow = []
    for h in range(hosts):
        rs = [r for r in runs if r["host"] == h]
        okr = [r for r in rs if r["class"] == "ok"]
        gb = [row.get("gb_per_s", 0) for r in okr for row in r["rows"]]
        moved = bytes_in(deltas, 0, 1e18, {h})
        prow.append(["h%d" % h, ",".join("h%d" % t for t in setup.get("targets", {}).get(str(h), [])), len(rs), len(okr),
                     "%.3f" % (statistics.median(gb) if gb else 0), "%.2f" % (moved / 1e9)])
        if not okr:
            fail.append("initiator h%d: no bench run ended well" % h)
        elif phs and max(r["t1"] for r in okr) < phs[-1].get("heal", 0):
            fail.append("initiator h%d: no bench run ended well after the last heal" % h)
    out.append("")
    out.append("Per initiator (bench runs: each a WRITE and a READ step, every byte checked):")
    out.append(table(["initiator", "targets", "runs", "ok", "step GB/s p50", "GB moved"], prow))

    # Growth of the long-lived serves and etcd members, phase by phase.
    ll = long_lived(samples, "serve-")
    grow_rows = []
    ends = [(ph["name"], ph.get("end", t_end)) for ph in phs]
    per_phase = {}
    for name, e in ends:
        tot = {"gor": 0, "fds": 0, "rss": 0}
        for label in ll:
            for key in tot:
                v = median_fig(samples, label, key, e - 3, e)
                per_phase.setdefault(label, {}).setdefault(name, {})[key] = v
                tot[key] += v or 0
        grow_rows.append([name, len(ll), "%d" % tot["gor"], "%d" % tot["fds"], "%.0f" % (tot["rss"] / (1 << 20))])
    out.append("")
    out.append("Long-lived serves (never restarted), summed, at the end of each phase (median of its last 3 s):")
    out.append(table(["phase", "serves", "goroutines", "descriptors", "RSS MiB"], grow_rows))
    if len(ends) >= 2:
        for label in ll:
            fail += growth_check(per_phase[label][ends[0][0]], per_phase[label][ends[-1][0]], label, "serve")
    text = "\n".join(out)
    with open(os.path.join(run, "tables.txt"), "w") as f:
        f.write(text + "\n")
    print(text)

    # Plot: GB/s per initiator (1 s bins) and the long-lived serves' totals.
    if samples:
        t0 = phs[0]["start"] - 8 if phs else samples[0]["t"]
        series = []
        for h in range(hosts):
            pts, t = [], t0
            while t + 1 <= t_end:
                pts.append((t + 0.5, rate(deltas, t, t + 1, {h}) / 1e9))
                t += 1
            series.append(("h%d" % h, pts))
        gor, fds = [], []
        for s in samples:
            if t0 <= s["t"] <= t_end:
                g = [figures(s, l).get("gor") for l in ll]
                d = [figures(s, l).get("fds") for l in ll]
                if all(v is not None for v in g):
                    gor.append((s["t"], sum(g)))
                if all(v is not None for v in d):
                    fds.append((s["t"], sum(d)))
        bands = [(ph["fault"], ph.get("heal", ph["fault"]), ph["name"]) for ph in phs if "fault" in ph]
        svg_plot(os.path.join(run, "cluster.svg"), "moonring cluster in a box: %d hosts, KV workload; faults shaded" % hosts, t0, t_end,
                 [("GB/s per initiator", series), ("long-lived serves", [("goroutines", gor), ("descriptors", fds)])], bands)

    if fail:
        print("\nFAIL:", file=sys.stderr)
        for f in fail:
            print("  " + f, file=sys.stderr)
        return 1
    print("\nPASS: every bench run ended (no hang), every request counted in exactly one terminal status, every byte checked, failures only where a fault touched the run, recovery within %.0fs, no growth" % recover_max)
    return 0


# --- soak analysis ----------------------------------------------------------

# Soak growth: the median over the last third against the median over the
# first third (after a warm-up of a tenth): at most SOAK_SHARE times it
# plus the slack.
SOAK_SHARE = 1.2
SOAK_SLACK = {"gor": 10, "fds": 10, "rss": 32 << 20}


def soak(run):
    events = load_jsonl(os.path.join(run, "events.jsonl"))
    samples = load_jsonl(os.path.join(run, "samples.jsonl"))
    runs = load_jsonl(os.path.join(run, "bench", "runs.jsonl"))
    st = next(e for e in events if e["ev"] == "start")
    t_end = next((e["t"] for e in events if e["ev"] == "end"), samples[-1]["t"])
    t0 = st["t"]
    span = t_end - t0
    restarts = [e for e in events if e["ev"] == "restart"]
    restarted = [e for e in events if e["ev"] == "restarted"]
    fail = []
    out = []

    def expected(r):
        segs = set(r["segments"].split(","))
        for e in restarts:
            done = next((x["t"] for x in restarted if x["t"] >= e["t"] and x.get("old") == e["name"]), e["t"] + 30)
            if e["name"] in segs and not (r["t0"] > done + 2 or r["t1"] < e["t"]):
                return True
        return False

    by = {}
    for r in runs:
        r.setdefault("host", -1)
        cls = classify(r, [])
        if cls == "unexpected" and expected(r):
            cls = "expected"
        r["class"] = cls
        by.setdefault(r["kind"], []).append(r)
        if cls in ("hang", "corrupt", "crash", "lost", "unexpected"):
            fail.append("bench run %s #%d (%s, %.0fs in, rc %d): %s: %s" % (r["kind"], r["seq"], r["segments"], r["t0"] - t0, r["rc"], cls, r.get("err") or "(no message)"))
    rows = []
    for kind, rs in sorted(by.items()):
        cnt = {}
        for r in rs:
            cnt[r["class"]] = cnt.get(r["class"], 0) + 1
        steps = [row for r in rs if r["class"] == "ok" for row in r["rows"]]
        gb = {}
        for row in steps:
            key = "%s %s" % (row.get("op"), row.get("block") if row.get("pattern") != "kv" else "kv")
            gb.setdefault(key, []).append(row.get("gb_per_s", 0))
        gbs = "; ".join("%s %.2f" % (k, statistics.median(v)) for k, v in sorted(gb.items()))
        rows.append([kind, len(rs), " ".join("%s %d" % (k, cnt[k]) for k in ("ok", "expected", "unexpected", "hang", "corrupt", "crash", "lost") if cnt.get(k)),
                     len(steps), gbs])
        if not cnt.get("ok"):
            fail.append("initiator loop %s: no run ended well" % kind)
    out.append("Soak: %.0fs, %d peer restarts (%s), %d bench runs" % (span, len(restarts),
               ", ".join("%s %d" % (s, sum(1 for e in restarts if e["signal"] == s)) for s in ("TERM", "KILL")), len(runs)))
    out.append("")
    out.append("Initiators (runs: ok, expected = failed across a restart of its peer; step GB/s medians, every step's bytes checked):")
    out.append(table(["loop", "runs", "by class", "steps ok", "GB/s by op and block"], rows))

    ll = [l for l in long_lived(samples, "") if l.startswith("metadata") or l.startswith("serve-L")]
    a0, a1 = t0 + span / 10, t0 + span / 3
    b0, b1 = t_end - span / 3, t_end
    grow = []
    for label in ll:
        first = {k: median_fig(samples, label, k, a0, a1) for k in SOAK_SLACK}
        last = {k: median_fig(samples, label, k, b0, b1) for k in SOAK_SLACK}
        peak = {k: max([figures(s, label).get(k) or 0 for s in samples] or [0]) for k in SOAK_SLACK}
        grow.append([label, fmtv("gor", first["gor"]), fmtv("gor", last["gor"]), fmtv("fds", first["fds"]), fmtv("fds", last["fds"]),
                     fmtv("rss", first["rss"]), fmtv("rss", last["rss"]), fmtv("rss", peak["rss"])])
        for k, slack in SOAK_SLACK.items():
            if first[k] is not None and last[k] is not None and last[k] > first[k] * SOAK_SHARE + slack:
                fail.append("%s: %s grew: median %s over the first third, %s over the last (rule: at most %.1fx + %s)" % (
                    label, {"gor": "goroutines", "fds": "descriptors", "rss": "RSS"}[k], fmtv(k, first[k]), fmtv(k, last[k]), SOAK_SHARE, fmtv(k, slack)))
    out.append("")
    out.append("Long-lived processes, medians over the first third (after a tenth of warm-up) and the last third:")
    out.append(table(["process", "goroutines first", "last", "fds first", "last", "RSS first", "last", "RSS peak"], grow))
    text = "\n".join(out)
    with open(os.path.join(run, "tables.txt"), "w") as f:
        f.write(text + "\n")
    print(text)

    panels = []
    for key, name, scale in (("rss", "RSS MiB", 1 << 20), ("fds", "descriptors", 1), ("gor", "goroutines", 1)):
        series = []
        for label in ll:
            pts = [(s["t"], figures(s, label).get(key) / scale) for s in samples if figures(s, label).get(key) is not None]
            if pts:
                series.append((label, pts))
        panels.append((name, series))
    bands = [(e["t"], e["t"] + max(0.5, span / 400), "") for e in restarts]
    svg_plot(os.path.join(run, "soak.svg"), "moonring soak: long-lived processes while peers restart (marks)", t0, t_end, panels, bands)
    if fail:
        print("\nFAIL:", file=sys.stderr)
        for f in fail:
            print("  " + f, file=sys.stderr)
        return 1
    print("\nPASS: no hang, crash or wrong byte; failures only across a peer's restart; no growth (last third's median <= %.1fx the first's + slack)" % SOAK_SHARE)
    return 0


def main(argv):
    cmd = argv[1] if len(argv) > 1 else ""
    if cmd == "wait-http":
        return wait_http(argv[2], argv[3], argv[4] if len(argv) > 4 else "")
    if cmd == "etcd-leader":
        return etcd_leader(argv[2:])
    if cmd == "sample":
        return sample(argv[2], argv[3])
    if cmd == "wait-recovered":
        return wait_recovered(argv[2], argv[3], argv[4])
    if cmd == "analyze":
        return analyze(argv[2])
    if cmd == "soak":
        return soak(argv[2])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
