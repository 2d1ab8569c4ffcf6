"""`make demo`: one research-agent session on the bundled digits experiment, on 2 CPU slots, then the leaderboard.

    python -m orchestrator.faces.demo [--trials 14] [--minutes 3] [--devices cpu:2] [--seed 0]

Uses the LLM proposer when `OPENAI_BASE_URL`/`OPENAI_API_KEY` are set, Optuna TPE otherwise. First the baseline (the
experiment's defaults) runs on 5 seeds (cheap, and with 3 its own noise swamps the gate); then 11 search trials
train for 6 epochs at scale 1 (seconds each on a laptop core; TPE's first ones each change one parameter of the
best configuration so far), ASHA stops weak ones after their first epochs, and the top candidate is re-run on three
fresh seeds. A winner is declared only if the mean of its fresh re-runs (never the search run that selected it)
beats the baseline's by more than the seed noise (Welch's t-test, 95% CI); otherwise the demo says that no
improvement was found. Everything lands in `AUTORESEARCH_HOME` (default ~/.autoresearch): browse it with
`autoresearch ui`.
"""

from __future__ import annotations

import argparse
import sys


# The baseline's spread is most of the gate's noise: with 3 seeds Welch has about 2 degrees of freedom (t = 6.2
# at 97.5%), with 5 about 4 (t = 3.5). Five default runs cost seconds each and run first, two at a time.
BASELINE_SEEDS = 5
# One candidate re-run, not two: a second costs 3 of the 14 jobs and Bonferroni widens both intervals (t = 3.2
# instead of 2.6 at about 5 degrees of freedom), while the search gets 11 trials instead of 8: enough for a
# one-parameter move on each of the 10 parameters digits' MLP searches (benchmarks/digits_moves.py).
CONFIRM_TOP = 1


def main(argv: list[str] | None = None) -> int:
    """Run the demo session and print its leaderboard; the exit code says whether it worked."""
    parser = argparse.ArgumentParser(prog="python -m orchestrator.faces.demo", description=__doc__.splitlines()[0])
    # 14 = 11 search trials + 1 candidate x 3 fresh re-runs (the baseline's 5 runs come on top).
    parser.add_argument("--trials", type=int, default=14, help="jobs in all, re-runs included (default 14)")
    parser.add_argument("--minutes", type=float, default=3.0, help="time budget (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="the sampler's seed (default 0)")
    parser.add_argument("--devices", default="cpu:2", help="devices of the embedded service (default cpu:2)")
    args = parser.parse_args(argv)

    from orchestrator.agent import runner
    from orchestrator.agent.proposers.factory import default_name
    from orchestrator.agent.session import SessionConfig, new_id
    from orchestrator.faces.cli.agent import _print_summary, _proposer_note, progress, show
    from orchestrator.core.config import Settings
    from orchestrator.core.errors import BadInput

    settings = Settings.load()
    proposer = default_name()
    config = SessionConfig(goal="Maximise validation accuracy on handwritten digits with a small, fast model.",
                           experiment="digits", proposer=proposer, trials=args.trials,
                           budget_minutes=args.minutes, fixed={"epochs": 6, "scale": 1}, model=settings.llm_model,
                           seed=args.seed, baseline_seeds=BASELINE_SEEDS, confirm_top=CONFIRM_TOP)
    try:
        runner.check(config, settings, args.devices)
    except BadInput as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 2
    session_id = new_id()
    print(f"autoresearch demo: session {session_id} on digits, {args.trials} trials or {args.minutes:g} minutes "
          f"on {args.devices}; {_proposer_note(proposer, settings)}", flush=True)
    print(f"home: {settings.home}", flush=True)
    summary = runner.start(config, settings=settings, session_id=session_id, devices=args.devices,
                           on_event=progress)
    print()
    _print_summary(summary)
    print()
    show(runner.leaderboard("digits", settings), top=8)
    print(f"\nbrowse the runs: autoresearch ui   (MLflow on {settings.tracking_uri})")
    # A winner or an honest "no improvement" are both results; a session without a measured baseline is not.
    return 0 if summary.get("baseline") else 1


if __name__ == "__main__":
    sys.exit(main())
