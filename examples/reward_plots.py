"""The GRPO examples' reward curves as PNGs: one run, several seeds' spread, two trainers side by side.

``train_tiny_grpo.py`` and ``train_trl_grpo.py`` both plot with these (the script's own folder is on
``sys.path`` when run as ``python examples/...``). matplotlib is optional (``prorl[train]``): without
it each plot prints why and writes no PNG; the examples write their JSON files either way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

#: One value per evaluation: ``(GRPO step, value)`` pairs (lists once read back from JSON).
Curve = Sequence[Sequence[float]]
#: Per evaluation point: ``(step, mean, min, max)`` over seeds.
Spread = list[tuple[int, float, float, float]]


def spread(curves: Sequence[Curve]) -> Spread:
    """Per evaluation point: (step, mean, min, max) of the value over ``curves``, all evaluated at the same steps."""
    points = []
    for i, (step, _) in enumerate(curves[0]):
        values = [c[i][1] for c in curves]
        points.append((int(step), sum(values) / len(values), min(values), max(values)))
    return points


def _save(path: Path, draw: Callable[[Any], None], *, ylabel: str, figsize: tuple[float, float] = (5, 3.2),
          **legend: Any) -> None:
    """One figure: ``draw(ax)``, then the frame every reward plot shares (step axis, reward in [0, 1]), saved to ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed (pip install 'prorl[train]'): no {path.name}", flush=True)
        return
    fig, ax = plt.subplots(figsize=figsize)
    try:
        draw(ax)
        ax.set_xlabel("GRPO step")
        ax.set_ylabel(ylabel)
        ax.set_ylim(-0.02, 1.02)
        ax.legend(**legend)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


def plot_run(path: Path, curve: Curve, train_rewards: Sequence[float], tool_use: Curve = ()) -> None:
    """One run: held-out reward per evaluation, each step's sampled training reward, and held-out tool use."""

    def draw(ax: Any) -> None:
        ax.plot([s for s, _ in curve], [r for _, r in curve], marker="o", label="held-out")
        ax.plot(range(1, len(train_rewards) + 1), train_rewards, alpha=0.5, label="train (sampled)")
        if tool_use:
            ax.plot([s for s, _ in tool_use], [u for _, u in tool_use], linestyle="--", label="held-out tool use")

    _save(path, draw, ylabel="mean reward")


def plot_seeds(path: Path, curves: dict[int, Curve], points: Spread) -> None:
    """Each seed's held-out curve (``curves`` by seed) and their mean (``points``, from :func:`spread`)."""

    def draw(ax: Any) -> None:
        for seed, curve in curves.items():
            ax.plot([s for s, _ in curve], [v for _, v in curve], marker=".", alpha=0.45, label=f"seed {seed}")
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color="black", label="mean")

    _save(path, draw, ylabel="held-out mean reward", fontsize=8)


def plot_spreads(path: Path, series: Sequence[tuple[str, Spread]]) -> None:
    """Several trainers' held-out reward over seeds: per ``(label, points)``, the mean and a [min, max] band."""
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:red")

    def draw(ax: Any) -> None:
        for (label, points), color in zip(series, colors, strict=False):
            steps = [p[0] for p in points]
            ax.fill_between(steps, [p[2] for p in points], [p[3] for p in points], color=color, alpha=0.2)
            ax.plot(steps, [p[1] for p in points], marker="o", color=color, label=label)

    _save(path, draw, ylabel="held-out mean reward", figsize=(5.5, 3.4), fontsize=8, loc="upper left")
