"""Program mode: the agent edits a training program's code (the programs contract: docs/guides/program-mode.md).

A program is a git repository (or a folder inside one) with an `autoresearch.toml`. Each trial is a commit
made from its parent plus the model's search/replace edits, run from its own worktree under the home through
the ordinary queue, with its metric read from MLflow. Modules, one job each:

- `spec`: the program's `autoresearch.toml`, validated.
- `repo`: git plumbing (session branch, one commit per trial, one worktree per running trial).
- `edits`: applying and validating the model's edits before anything runs.
- `answers`: the prompt and the parsing of the model's JSON answers.
- `governor`: when a session changes course, and when it stops.
- `trial`: one trial (a job running one commit on one seed): its kind, status and verdict.
- `tree`: the session's trials and nodes, persisted after every step (kill -9 safe).
- `loop`: K variants in flight (ask, commit, submit, read); `judge`: re-runs, the noise gate, verdicts.
- `propose`: one step's question to the model, with bounded re-asks.
- `session`: `start`, `resume`, `lineage` (`autoresearch tree`) and the program leaderboard.
- `wrap`: the job-side wrapper: reads `<metric>: <number>` lines (logged to the run), runs the sandbox.
- `sandbox`: the bubblewrap command line for `--sandbox`.
"""
