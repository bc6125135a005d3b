#!/usr/bin/env python3
"""Plots the tables of a `cargo xtask bench` run (target/bench/results.md)
into docs/bench-*.png. Needs matplotlib (Debian's python3-matplotlib, which
`cargo xtask setup` installs; `cargo xtask bench` runs this with /usr/bin/python3)."""
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def tables(text):
    """Section title -> rows (lists of cells) of the table under it."""
    out, title = {}, None
    for line in text.splitlines():
        if line.startswith("## "):
            title = line[3:]
            out[title] = []
        elif title and line.startswith("|") and not line.startswith("|---") and not set(line) <= set("|-: "):
            out[title].append([c.strip() for c in line.strip("|").split("|")])
    return {t: rows[1:] for t, rows in out.items() if rows}  # drop header rows


def find(tabs, prefix):
    """The rows of the section numbered `prefix`, or None when this run
    skipped it (LBAGENT_BENCH_SECTIONS)."""
    return next((rows for t, rows in tabs.items() if t.startswith(prefix)), None)


def main():
    root = Path(__file__).resolve().parent.parent
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else root / "target/bench/results.md"
    tabs = tables(src.read_text())

    wrote = []
    cost = find(tabs, "1.")
    if cost:
        plot_cost(root, cost)
        wrote.append("docs/bench-program-cost.png")
    conn = find(tabs, "2.")
    if conn:
        plot_conn(root, conn)
        wrote.append("docs/bench-conn-rate.png")
    flows = section_tables(src.read_text(), "17.")
    if flows:
        plot_flows(root, flows)
        wrote += ["docs/bench-flow-memory.png", "docs/bench-flow-gc.png"]
    print("wrote " + ", ".join(wrote) if wrote else "no plotted section in this run (sections 1, 2 and 17 are plotted)")


def section_tables(text, prefix):
    """The tables of the section numbered `prefix`, each a list of rows
    (lists of cells) with its header row first; None when the run skipped
    the section."""
    inside, tabs, current = False, [], None
    for line in text.splitlines():
        if line.startswith("## "):
            inside = line[3:].startswith(prefix)
            continue
        if not inside:
            continue
        if line.startswith("|"):
            if set(line) <= set("|-: "):
                continue
            if current is None:
                current = []
                tabs.append(current)
            current.append([c.strip() for c in line.strip("|").split("|")])
        else:
            current = None
    return tabs or None


def seconds(cell, i):
    """The i-th figure of a cell such as `0.10 s / 0.10 s / 7 MB`."""
    return float(cell.split("/")[i].split()[0])


def plot_cost(root, cost):
    n = [int(r[0]) for r in cost]
    plt.figure(figsize=(6, 3.5))
    plt.plot(n, [float(r[1]) for r in cost], "o-", label="established flow")
    plt.plot(n, [float(r[2]) for r in cost], "s-", label="unmatched packet")
    plt.xscale("log")
    plt.ylim(bottom=0)
    plt.xlabel("DNAT rules in the map")
    plt.ylabel("ns / packet (PROG_TEST_RUN)")
    plt.title("eBPF program cost vs rule count")
    plt.legend()
    plt.tight_layout()
    plt.savefig(root / "docs/bench-program-cost.png", dpi=110)


def plot_conn(root, conn):
    n = [int(r[0]) for r in conn]
    plt.figure(figsize=(6, 3.5))
    for col, label, style in [(1, "eBPF engine", "o-"), (2, "iptables (reference rules)", "s-"), (3, "plain routing, no NAT", "^--")]:
        plt.plot(n, [float(r[col]) for r in conn], style, label=label)
    plt.xscale("log")
    plt.ylim(bottom=0)
    plt.xlabel("NAT rules")
    plt.ylabel("new TCP connections / s")
    plt.title("Connection setup rate through the NAT namespace")
    plt.legend()
    plt.tight_layout()
    plt.savefig(root / "docs/bench-conn-rate.png", dpi=110)


def flow_axis(n):
    """A linear axis (cost per flow reads as a straight line) with a tick at
    each size measured."""
    plt.xlim(0, max(n) * 1.05)
    plt.xticks(n, [f"{round(x / 1000)} k" for x in n])


def plot_flows(root, tabs):
    ebpf = next(t for t in tabs if t[0][0] == "flows" and "`ct` B/flow" in t[0])[1:]
    linux = next((t for t in tabs if t[0][0] == "flows" and "entries" in t[0]), [[]])[1:]
    n = [int(r[0]) for r in ebpf]
    plt.figure(figsize=(6, 3.5))
    plt.plot(n, [float(r[2]) for r in ebpf], "o-", label="eBPF `ct`, both halves")
    plt.plot(n, [float(r[3]) for r in ebpf], "o--", label="eBPF with `ct_new` (its default quarter)")
    if linux:
        plt.plot([int(r[0]) for r in linux], [float(r[3]) for r in linux], "s-", label="Linux conntrack (slab + hash)")
    flow_axis(n)
    plt.ylim(bottom=0)
    plt.xlabel("flows the table holds")
    plt.ylabel("kernel bytes per flow")
    plt.title("Memory per flow")
    plt.legend()
    plt.tight_layout()
    plt.savefig(root / "docs/bench-flow-memory.png", dpi=110)

    plt.figure(figsize=(6, 3.5))
    plt.plot(n, [seconds(r[5], 1) for r in ebpf], "o-", label="GC pass, nothing idle (CPU s)")
    plt.plot(n, [seconds(r[7], 1) for r in ebpf], "s-", label="GC pass freeing every flow (CPU s)")
    plt.plot(n, [seconds(r[6], 1) for r in ebpf], "^--", label="`conntrack list --addr` (CPU s)")
    flow_axis(n)
    plt.ylim(bottom=0)
    plt.xlabel("established flows")
    plt.ylabel("CPU seconds (release agent)")
    plt.title("Conntrack passes against table size")
    plt.legend()
    plt.tight_layout()
    plt.savefig(root / "docs/bench-flow-gc.png", dpi=110)


if __name__ == "__main__":
    main()
