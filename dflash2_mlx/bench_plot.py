"""`dflash2 bench --plot`: acceptance by block position as a PNG (matplotlib, optional)."""

from __future__ import annotations

from .bench import BenchReport
from .errors import ConfigError

MIN_CYCLES = 10  # plotted acceptance from fewer cycles is drawn faded


def plot_acceptance(report: BenchReport, path) -> None:
    """PNG: conditional acceptance by block position, one line per speculative mode; one panel
    for all suites together and one per suite."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'dflash2-mlx[plot]'") from None
    summary = report.summary()
    panels = [("all suites", summary["overall"]), *summary["by_suite"].items()]
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows), squeeze=False, sharey=True)
    for ax, (title, figures) in zip(axes.flat, panels):
        for mode, f in figures.items():
            points = [(i + 1, v, n) for i, (v, (_, n)) in enumerate(zip(f["acceptance_by_position"],
                                                                       f["acceptance_counts"])) if v is not None]
            if points:
                line, = ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                                label=f"{mode} (τ {f['tau']:.2f})")
                for x, y, n in points:  # how many cycles the point rests on; a thin point is faded
                    ax.annotate(str(n), (x, y), textcoords="offset points", xytext=(0, 5), fontsize=6,
                                ha="center", color=line.get_color(), alpha=1.0 if n >= MIN_CYCLES else 0.4)
        ax.set_title(title)
        ax.set_xlabel("block position")
        ax.set_ylim(0, 1.02)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    axes[0][0].set_ylabel("P(accepted | earlier accepted)")
    fig.suptitle(f"Acceptance by block position ({report.settings['n_prompts']} prompts, "
                 f"T={report.settings['sampling']['temperature']}; labels: cycles that reached each position)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
