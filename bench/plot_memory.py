#!/usr/bin/env python3
"""Peak unsharded memory per rank against the world size, one line per sharding strategy and
one for the FSDP2 + torch.optim.Muon peer, from the memory.tsv fsdp_strategies_bench writes:

    python3 bench/plot_memory.py memory.tsv memory.png

Columns of the TSV: world, series (optim, optim_grads, optim_grads_params, fsdp2_muon),
peak_unsharded_mib, sharded_state_mib, two_groups_mib. Two charts: the peak of unsharded
weights + gradients (with the ZeRO-3 goal, two groups' worth, dashed), and that plus the sharded
state. Drawn with matplotlib, which scripts/setup installs into the project's venv.
"""

import sys

try:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
except ImportError:
    sys.exit(
        f"plot_memory.py: matplotlib is not installed for {sys.executable}; run scripts/setup "
        "(it installs matplotlib into the project's venv) or `pip install matplotlib`"
    )

SERIES = [  # name in the TSV, legend, colour
    ("optim", "fsdp_muon optim (ZeRO-1)", "tab:blue"),
    ("optim_grads", "fsdp_muon optim_grads (ZeRO-2)", "tab:orange"),
    ("optim_grads_params", "fsdp_muon optim_grads_params (ZeRO-3)", "tab:green"),
    ("fsdp2_muon", "PyTorch FSDP2 + torch.optim.Muon", "tab:red"),
]


def read_tsv(path):
    rows = []
    with open(path) as f:
        header = f.readline().rstrip("\n").split("\t")
        for line in f:
            if line.strip():
                rows.append(dict(zip(header, line.rstrip("\n").split("\t"))))
    if not rows:
        sys.exit(f"plot_memory.py: {path} has no rows")
    return rows


def panel(ax, title, worlds, data, two_groups=None):
    """One chart: a line per series against W (and the two-groups goal, dashed)."""
    for name, label, colour in SERIES:
        ws = [w for w in worlds if w in data[name]]
        ax.plot(ws, [data[name][w] for w in ws], marker="s", linewidth=2, color=colour,
                label=label)
    if two_groups:
        ax.plot(worlds, [two_groups[w] for w in worlds], linestyle="--", color="grey",
                label="two groups' worth (ZeRO-3 goal: at most this)")
    ax.set_title(title)
    ax.set_xlabel("W (ranks)")
    ax.set_ylabel("MiB per rank")
    ax.set_xticks(worlds)
    ax.set_ylim(bottom=0)
    ax.grid(True, color="0.9")


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: plot_memory.py memory.tsv memory.png")
    rows = read_tsv(sys.argv[1])
    worlds = sorted({int(r["world"]) for r in rows})
    unsharded = {name: {} for name, _, _ in SERIES}
    total = {name: {} for name, _, _ in SERIES}
    two_groups = {}
    for r in rows:
        if r["series"] not in unsharded:
            sys.exit(f"plot_memory.py: unknown series {r['series']!r}")
        w = int(r["world"])
        unsharded[r["series"]][w] = float(r["peak_unsharded_mib"])
        total[r["series"]][w] = float(r["peak_unsharded_mib"]) + float(r["sharded_state_mib"])
        two_groups[w] = float(r["two_groups_mib"])

    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 6.4), dpi=100)
    fig.suptitle("Memory per rank (MiB) against the world size")
    panel(left, "Peak unsharded weights + grads", worlds, unsharded, two_groups)
    panel(right, "That + sharded state (shards, optimizers)", worlds, total)
    handles, labels = left.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.5, 0.04), ncol=3,
               frameon=False)
    fig.text(0.5, 0.012,
             "Activations are in neither. Sharded state: main weight / parameter and gradient "
             "shards, AdamW moments, Muon momentum, as allocated after a step.",
             ha="center", fontsize=9)
    fig.tight_layout(rect=(0, 0.15, 1, 1))
    fig.savefig(sys.argv[2])
    width, height = fig.canvas.get_width_height()
    print(f"plot_memory.py: wrote {sys.argv[2]} ({width}x{height})")


if __name__ == "__main__":
    main()
