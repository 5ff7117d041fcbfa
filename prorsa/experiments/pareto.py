"""The Pareto front of a two-objective tuning study (makespan x switches) as a plot."""

from __future__ import annotations

from pathlib import Path

from prorsa.experiments.report import COLORS, _plt


def pareto_plot(study, path: Path) -> Path:
    """All complete trials, the Pareto-optimal ones joined by their front, and the trial
    :func:`prorsa.tune.best_trial` picks (lowest first objective on the front)."""
    from optuna.trial import TrialState

    from prorsa.tune import best_trial

    plt = _plt()
    names = study.user_attrs.get("settings", {}).get("objectives", ["objective", "switches"])
    policy = study.user_attrs.get("settings", {}).get("policy", "")
    trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    front = sorted(study.best_trials, key=lambda t: (t.values[1], t.values[0]))
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ax.scatter(
        [t.values[1] for t in trials],
        [t.values[0] for t in trials],
        s=14,
        color="#bbbbbb",
        label=f"trials ({len(trials)})",
    )
    if front:
        # Fewer switches cost makespan along the front; drawn as the staircase it attains.
        ax.step(
            [t.values[1] for t in front],
            [t.values[0] for t in front],
            where="post",
            color=COLORS.get(policy, "#1f77b4"),
            marker="o",
            label=f"Pareto front ({len(front)})",
        )
        chosen = best_trial(study)
        ax.scatter(
            [chosen.values[1]],
            [chosen.values[0]],
            s=90,
            facecolors="none",
            edgecolors="black",
            label=f"used by compare --tuned (trial {chosen.number})",
        )
    ax.set_xlabel(f"{names[1]} (mean role switches per run)")
    ax.set_ylabel(f"{names[0]} (makespan s, or s per trajectory in async)")
    ax.set_title(f"{study.study_name}: makespan x switches")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
