#!/usr/bin/env python3
"""Plots the tables of a `cargo xtask bench` run (target/bench/results.md)
into docs/bench-*.png. Needs matplotlib (`pip install matplotlib`)."""
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
    return next(rows for t, rows in tabs.items() if t.startswith(prefix))


def main():
    root = Path(__file__).resolve().parent.parent
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else root / "target/bench/results.md"
    tabs = tables(src.read_text())

    cost = find(tabs, "1.")
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

    conn = find(tabs, "2.")
    n = [int(r[0]) for r in conn]
    plt.figure(figsize=(6, 3.5))
    for col, label, style in [(1, "eBPF engine", "o-"), (2, "iptables (seed rules)", "s-"), (3, "plain routing, no NAT", "^--")]:
        plt.plot(n, [float(r[col]) for r in conn], style, label=label)
    plt.xscale("log")
    plt.ylim(bottom=0)
    plt.xlabel("NAT rules")
    plt.ylabel("new TCP connections / s")
    plt.title("Connection setup rate through the NAT namespace")
    plt.legend()
    plt.tight_layout()
    plt.savefig(root / "docs/bench-conn-rate.png", dpi=110)
    print("wrote docs/bench-program-cost.png, docs/bench-conn-rate.png")


if __name__ == "__main__":
    main()
