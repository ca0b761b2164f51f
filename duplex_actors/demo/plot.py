"""A PNG timeline of one conversation: who spoke when, and where the user barged in."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .caller import Timeline


def plot_timeline(timeline: Timeline, path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 3))
    for start, end, _text in timeline.user_speech:
        ax.broken_barh([(start, end - start)], (10, 8), facecolors="tab:blue")
    merged: list[list[float]] = []
    for start, end in sorted(timeline.model_audio):
        if merged and start <= merged[-1][1] + 0.05:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    for start, end in merged:
        ax.broken_barh([(start, end - start)], (0, 8), facecolors="tab:orange")
    for t in timeline.barge_ins:
        ax.axvline(t, color="red", linestyle="--", linewidth=1)
    for t in timeline.backchannels:
        ax.axvline(t, color="green", linestyle=":", linewidth=1)
    ax.set_yticks([4, 14])
    ax.set_yticklabels(["model", "user"])
    ax.set_xlabel("seconds")
    ax.set_title(f"{title}: user speech (blue), model audio (orange), barge-in (red), backchannel (green)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
