"""The bench's plot (``--plot``, matplotlib from the ``bench`` extra): tokens/s per batch size and
acceptance per draft position, one row of panels per checkpoint."""

from __future__ import annotations

from pathlib import Path


def plot(record: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    checkpoints = record["checkpoints"]
    fig, axes = plt.subplots(len(checkpoints), 2, figsize=(12, 4 * len(checkpoints)), squeeze=False)
    for (ax_rate, ax_acc), ck in zip(axes, checkpoints):
        series: dict[str, list[tuple[int, float]]] = {}
        for r in ck["rows"]:
            if r["mode"].startswith("prefill"):  # prompt tokens/s, not decode
                continue
            series.setdefault(f"{r['engine']} {r['mode']}", []).append((r["batch"], r["tokens_per_s"]))
        for label, points in sorted(series.items()):
            points.sort()
            ax_rate.plot([b for b, _ in points], [t for _, t in points], marker="o", label=label)
        ax_rate.set_xscale("log", base=2)
        ax_rate.set_xlabel("batch size")
        ax_rate.set_ylabel("decode tokens/s")
        ax_rate.set_title(f"{ck['checkpoint']} ({ck['dtype']})")
        ax_rate.legend(fontsize=8)
        for r in ck["rows"]:
            if "per_position_acceptance" in r:
                acc = r["per_position_acceptance"]
                ax_acc.plot(range(1, len(acc) + 1), acc, marker="o",
                            label=f"{r['engine']} {r['mode']} B={r['batch']} (accept {r['accept_length']:.2f})")
        ax_acc.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax_acc.set_xlabel("draft position")
        ax_acc.set_ylabel("acceptance rate")
        ax_acc.set_ylim(0, 1.05)
        ax_acc.set_title(f"{ck['checkpoint']}: acceptance per position")
        if ax_acc.lines:
            ax_acc.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
