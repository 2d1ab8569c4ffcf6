"""A program's holdout score: the protected evaluator run once, at the session's end, on the kept commit (and on
the baseline, to compare), as separate queue jobs the search never reads.

    scores = Holdout(spec, store=store, repo=repo, home=home, session=sid, root=root).score(nodes, jobs)

Each evaluation job: a worktree of the node's commit (protected files as at the session's root commit, the
holdout files copied in from the program folder: the only place they ever enter a worktree), the job's cwd the
program folder in it, `AUTORESEARCH_OUTPUT_DIR` the checkpoint directory of the node's first run (its output),
the program's `holdout_eval` under the output-line wrapper (`holdout_metric`). The job is found again by its
idempotency key, so a resumed session neither loses nor repeats one.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

from orchestrator.agent.history import device_seconds
from orchestrator.programs.trial import ProgramTrial
from orchestrator.core import outputmetrics

OUTPUT_VAR = "AUTORESEARCH_OUTPUT_DIR"


class Holdout:
    """Evaluation jobs of one program session's nodes on the holdout."""

    def __init__(self, spec: Any, *, store: Any, repo: Any, home: Path, session: str, root: str,
                 priority: int = 0, poll: float = 0.5, notify: Callable[[], None] = lambda: None):
        self.spec, self.store, self.repo, self.home = spec, store, repo, Path(home)
        self.session, self.root, self.priority, self.poll, self.notify = session, root, priority, poll, notify

    def score(self, nodes: list[ProgramTrial], output_of: Callable[[ProgramTrial], str | None]
              ) -> dict[int, dict[str, Any]]:
        """{node: {"value", "error", "device_s", "job_id"}} for each node trial, once its job has ended;
        `output_of(node)` is the checkpoint directory of the node's first run."""
        jobs = {t.n: self._submit(t, output_of(t)) for t in nodes}
        while not all(self.store.get(j).final for j in jobs.values()):
            time.sleep(self.poll)
        out = {}
        for n, job_id in jobs.items():
            job = self.store.get(job_id)
            values = [v for _, v in outputmetrics.read(job.checkpoint_dir)] if job.state == "SUCCEEDED" else []
            error = "" if values else (f"no {self.spec.eval_metric} line" if job.state == "SUCCEEDED"
                                       else f"{job.state.lower()}: exit code {job.exit_code}: {job.reason}"[:300])
            out[n] = {"value": values[-1] if values else None, "error": error, "job_id": job_id,
                      "device_s": device_seconds(self.store, job)}
            if self._worktree(n).exists():
                self.repo.remove_worktree(self._worktree(n))
        return out

    def _worktree(self, n: int) -> Path:
        return self.home / "programs" / self.session / f"holdout-{n}"

    def _submit(self, node: ProgramTrial, output: str | None) -> int:
        from orchestrator.queue.models import JobSpec

        key = f"{self.session}:holdout:{node.n}"
        job = self.store.find_by_key(key)
        if job is not None:
            return job.id
        worktree = self.repo.add_worktree(self._worktree(node.n), node.commit)
        self.repo.restore_protected(worktree, self.root, [self.spec.repo_path(p) for p in self.spec.protected])
        cwd = worktree / self.spec.prefix if self.spec.prefix else worktree
        for name in self.spec.holdout:
            source, target = self.spec.root / name, cwd / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if source.is_dir():
                shutil.copytree(source, target, dirs_exist_ok=True)
            else:
                shutil.copy2(source, target)
        argv = [sys.executable, "-m", "orchestrator.programs.wrap", "--metric", self.spec.eval_metric,
                "--pattern", self.spec.pattern, "--", *self.spec.eval_argv]
        job = self.store.submit(JobSpec(
            argv=argv, name=f"{self.spec.name}-{self.session}-holdout-{node.n}", priority=self.priority, gpus=1,
            max_attempts=1, grace=10.0, owner=self.session, cwd=str(cwd), idempotency_key=key, track=False,
            time_limit=self.spec.time_limit, env={OUTPUT_VAR: output or "", "AUTORESEARCH_SEED": "0"},
            params={"commit": node.commit, "holdout": True}))
        self.notify()
        return job.id
