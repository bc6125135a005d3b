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
    print("wrote " + ", ".join(wrote) if wrote else "no plotted section in this run (sections 1 and 2 are plotted)")


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


if __name__ == "__main__":
    main()
