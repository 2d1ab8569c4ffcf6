"""The program-mode loop: keep K variants in flight, read their metrics, gate children against parents.

    loop = Loop(session_id, config, spec, ...)     # built by `orchestrator.programs.session`
    summary = loop.run()

Each pass: look at the session's jobs (record finished runs, their metrics and log tails), judge nodes (a
crashed one asks for a debug step; a succeeded one gets re-runs on fresh seeds, then the noise gate against
its parent decides kept or discarded; the governor counts outcomes), then fill free slots with proposals
(debug first, else draft or improve from the incumbent). Every record is saved before the step that depends
on it (see `tree`), so `resume` continues from any point.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from orchestrator.agent.history import device_seconds
from orchestrator.agent.session import cancelled_by_stop
from orchestrator.core import outputmetrics
from orchestrator.programs import answers, propose, tree
from orchestrator.programs.governor import Governor
from orchestrator.programs.judge import Judge
from orchestrator.programs.memory import Memory
from orchestrator.programs.trial import ACTIVE, Kind, ProgramTrial, S
from orchestrator.programs.wrap import log_tail
from orchestrator.queue.states import TIME_LIMIT
from orchestrator.tracking.client import run_status

TAIL = 3000


class Loop:
    """One program session's loop over live resources (store, tracker, repo, LLM); verdicts come from its `Judge`."""

    def __init__(self, *, session_id: str, config: Any, spec: Any, store: Any, tracker: Any, repo: Any,
                 trees: tree.TreeStore, llm: Any, parallel: int, home: Path, parent_run: str,
                 notify: Callable[[], None] = lambda: None, say: Callable[[str], None] = lambda s: None,
                 on_usage: Callable[[dict], None] = lambda u: None):
        self.sid, self.cfg, self.spec = session_id, config, spec
        self.store, self.tracker, self.repo, self.trees, self.llm = store, tracker, repo, trees, llm
        self.parallel, self.home, self.parent_run = parallel, Path(home), parent_run
        self.notify, self.say, self.on_usage = notify, say, on_usage
        self.experiment = f"program:{spec.name}"
        self.trials: list[ProgramTrial] = trees.trials(session_id)
        self.state: dict = trees.state(session_id) or self._initial_state()
        self.gov = Governor.from_dict(self.state["governor"])
        self.judge = Judge(self)
        self.state.setdefault("program", str(spec.root))  # (a session from before the memory of earlier ones)
        # What earlier sessions on this program and start commit measured: never run again, shown compactly.
        self.memory = Memory.of(trees, session_id, program=str(spec.root), root=self.state["root"],
                                chars=config.memory_chars)
        self._tick = time.time()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"llm-{session_id}")
        self._asking: tuple[Future, answers.Step] | None = None
        # Worktrees of runs that ended, including any a killed session left behind.
        self._cleanup = [self._worktree(t) for t in self.trials
                         if t.status not in ACTIVE and self._worktree(t).exists()]

    # -- state -----------------------------------------------------------------------------------------------------

    def _initial_state(self) -> dict:
        root = self.repo.head()
        gov = Governor(max_failures=self.spec.max_failures, patience=self.spec.patience)
        state = {"root": root, "program": str(self.spec.root), "incumbent": 0, "governor": gov.to_dict(),
                 "pending_debug": [], "note": "", "drafts_left": self.parallel, "stop_reason": "", "usage": {},
                 "elapsed": 0.0, "rejected": 0}
        self.repo.set_ref(self.repo.branch(self.sid), root)
        self.trees.save_state(self.sid, state)
        return state

    def _save(self, t: ProgramTrial | None = None) -> None:
        if t is not None:
            self.trees.save(self.sid, t)
        self.state["governor"] = self.gov.to_dict()
        self.trees.save_state(self.sid, self.state)

    def _elapsed(self) -> float:
        now = time.time()
        self.state["elapsed"] += now - self._tick
        self._tick = now
        return self.state["elapsed"]

    def _time_up(self) -> bool:
        minutes = self.cfg.budget_minutes
        return minutes is not None and self.state["elapsed"] >= minutes * 60

    def _left(self) -> int | None:
        """Jobs the budget still allows, less the re-runs already owed to nodes being measured."""
        total = self.cfg.max_trials
        if total is None:
            return None
        owed = sum(max(0, self.spec.repeats - len(tree.runs_of(self.trials, t.n)))
                   for t in tree.nodes(self.trials) if t.kind is Kind.VARIANT and t.verdict is None
                   and t.status not in (S.FAILED, S.CANCELLED))
        return total - len(self.trials) - owed

    # -- the loop --------------------------------------------------------------------------------------------------

    def run(self) -> dict:
        """Run to the end: budget spent, time up, or the governor's stop; returns the summary."""
        # The baseline: the program as committed, on `repeats` seeds (completed after a crash mid-way).
        if all(t.kind is Kind.BASELINE for t in self.trials):
            for seed in range(len(self.trials), self.spec.repeats):
                self._add(tree.new_trial(self.sid, len(self.trials), kind=Kind.BASELINE, step="baseline", parent=None,
                                         parent_node=None, node=0, commit=self.state["root"], seed=seed,
                                         rationale="the program as committed"))
        while True:
            self._elapsed()
            self._sync()
            self.judge()
            active = [t for t in self.trials if t.status in ACTIVE]
            if not self.state["stop_reason"] and not self._time_up():
                self._fill()
                active = [t for t in self.trials if t.status in ACTIVE]
            idle = not active and self._asking is None
            if idle and (self.state["stop_reason"] or self._time_up() or not self._can_add()):
                break
            if not active and self._asking is not None and (self.state["stop_reason"] or self._time_up()):
                break  # an answer still being written would be thrown away: nothing of it was recorded
            self._save()
            self._tidy()
            time.sleep(self.cfg.poll)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._tidy()
        if not self.state["stop_reason"]:
            self.state["stop_reason"] = "time budget used" if self._time_up() else "trial budget used"
        self._save()
        self._holdout()
        return self.state

    def _holdout(self) -> None:
        """The incumbent's (and the baseline's) holdout score, by separate evaluation jobs, once at the end."""
        done = self.state.get("holdout") or {}
        if not self.spec.eval_argv or done.get("trial") == self.state["incumbent"] or not self.trials:
            return
        from orchestrator.programs.holdout import Holdout

        nodes = [self.trials[n] for n in sorted({0, self.state["incumbent"]})]
        scores = Holdout(self.spec, store=self.store, repo=self.repo, home=self.home, session=self.sid,
                         root=self.state["root"], priority=self.cfg.priority, poll=self.cfg.poll,
                         notify=self.notify).score(nodes, lambda t: self.store.get(t.job_id).checkpoint_dir)
        best, base = scores[self.state["incumbent"]], scores[0]
        self.state["holdout"] = {"trial": self.state["incumbent"], "metric": self.spec.eval_metric,
                                 "value": best["value"], "baseline": base["value"], "error": best["error"],
                                 "device_s": round(sum(s["device_s"] for s in scores.values()), 2)}
        self._save()
        self.say(f"holdout {self.spec.eval_metric}: " + (f"{best['value']:.5g} (baseline {base['value']:.5g})"
                                                         if best["value"] is not None and base["value"] is not None
                                                         else best["error"] or base["error"]))

    def _can_add(self) -> bool:
        left = self._left()
        return left is None or left >= self.spec.repeats

    # -- trials ----------------------------------------------------------------------------------------------------

    def _add(self, t: ProgramTrial) -> ProgramTrial:
        self.trials.append(t)
        self._save(t)  # recorded before its commit or job exists: a crash from here on loses nothing
        self._submit(t)
        return t

    def _submit(self, t: ProgramTrial) -> None:
        """Commit (variants), worktree, MLflow run and job, each found again if it already exists."""
        from orchestrator.queue.models import JobSpec

        if t.commit is None:
            ref = self.repo.trial_ref(self.sid, t.n)
            t.commit = self.repo.resolve(ref) or self.repo.commit(
                t.parent, {self.spec.repo_path(f): text for f, text in _take_files(t).items()},
                f"autoresearch {self.sid} trial {t.n} ({t.step}): {t.rationale or 'no rationale'}")
            self.repo.set_ref(ref, t.commit)
            t.files = None  # in the commit now (and out of the stored row)
            self._save(t)
        commit: str = t.commit
        job = self.store.find_by_key(t.job_key)
        if job is None:
            worktree = self.repo.add_worktree(self._worktree(t), commit)
            self.repo.restore_protected(worktree, self.state["root"], [self.spec.repo_path(p)
                                                                       for p in self.spec.protected])
            cwd = worktree / self.spec.prefix if self.spec.prefix else worktree
            node = self.trials[t.node]
            run_id = self.tracker.trial_run(
                self.parent_run, self.experiment, key=t.job_key, name=f"{self.sid} trial {t.n}",
                params={"commit": commit, "parent": node.parent or "", "seed": t.seed, "step": t.step},
                tags={"autoresearch.session": self.sid, "autoresearch.owner": self.sid,
                      "autoresearch.commit": commit, "autoresearch.parent": node.parent or "",
                      "autoresearch.rationale": node.rationale, "autoresearch.step": t.step,
                      "autoresearch.node": str(t.node),
                      "autoresearch.project": self.cfg.project})
            python = "python3" if self.spec.image else sys.executable  # an image has its own python
            argv = [python, "-m", "orchestrator.programs.wrap", "--metric", self.spec.metric,
                    "--pattern", self.spec.pattern]
            if self.cfg.sandbox:
                argv += ["--sandbox", str(worktree)]
                argv += [a for p in self.spec.protected for a in ("--protect", str(cwd / p))]
                argv += [a for p in self.spec.holdout for a in ("--hide", str(self.spec.root / p))]
            spec = JobSpec(argv=[*argv, "--", *self.spec.argv], name=f"{self.spec.name}-{self.sid}-{t.n}",
                           priority=self.cfg.priority, gpus=1, max_attempts=1, grace=10.0, preemptible=True,
                           owner=self.sid, project=self.cfg.project,
                           params={"commit": commit, "seed": t.seed},
                           env={"AUTORESEARCH_SEED": str(t.seed)}, cwd=str(cwd), mlflow_run_id=run_id,
                           idempotency_key=t.job_key, time_limit=self.spec.time_limit, image=self.spec.image)
            if spec.image:  # pinned to the image's content id; the run says which
                from orchestrator.api.jobenv import prepare
                from orchestrator.tracking.jobruns import image_tags

                spec = prepare(spec)
                self.tracker.set_tags(run_id, image_tags(spec))
            job = self.store.submit(spec)
            self.notify()
            self._log_patch(node, run_id, commit)
        elif t.status is S.PENDING and job.mlflow_run_id:  # submitted just before a crash: finish the record
            if "patch.diff" not in [a.path for a in self.tracker.client.list_artifacts(job.mlflow_run_id)]:
                self._log_patch(self.trials[t.node], job.mlflow_run_id, commit)
        t.update(job_id=job.id, run_id=job.mlflow_run_id, status=S.QUEUED if t.status is S.PENDING else t.status)
        self._save(t)
        if t.kind is Kind.VARIANT:
            self.say(f"trial {t.n} ({t.step}) commit {commit[:10]} from {(t.parent or '')[:10]} -> job "
                     f"{job.id}: {t.rationale}")

    def _worktree(self, t: ProgramTrial) -> Path:
        return self.home / "programs" / self.sid / str(t.n)

    def _tidy(self) -> None:
        """Remove the worktrees of finished runs (their commits stay)."""
        while self._cleanup:
            self.repo.remove_worktree(self._cleanup.pop())

    def _log_patch(self, node: ProgramTrial, run_id: str, commit: str) -> None:
        """The diff from the node's parent, as the run's `patch.diff` (logged after the submit: the device
        need not wait for the artifact store)."""
        if node.parent:
            self.tracker.client.log_text(run_id, self.repo.diff(node.parent, commit), "patch.diff")

    def _sync(self) -> None:
        """Submit what a crash left pending; record runs that started or ended."""
        for t in self.trials:
            if t.status is S.PENDING:
                self._submit(t)
            if t.status not in (S.QUEUED, S.RUNNING):
                continue
            job = self.store.get(t.job_id)
            if job.final and cancelled_by_stop(job, self.sid):
                self._run_again(t, job)
            elif job.final:
                self._finish(t, job)
            elif t.status is S.QUEUED and job.state == "RUNNING":
                t.status = S.RUNNING
                self._save(t)

    def _run_again(self, t: ProgramTrial, job: Any) -> None:
        """The trial as it was, on a fresh job, run and worktree: a stop costs no trial of the budget."""
        if t.run_id:
            self.tracker.finish(t.run_id, run_status(S.CANCELLED.value))
        self.repo.remove_worktree(self._worktree(t))
        t.run_again()
        self._save(t)
        self.say(f"trial {t.n}: job {job.id} was cancelled when the session stopped; running it again")
        self._submit(t)

    def _finish(self, t: ProgramTrial, job: Any) -> None:
        tail = log_tail(job.log_path, TAIL)
        if job.state == "SUCCEEDED":
            t.value = self._metric(t, job)
            t.status = S.SUCCEEDED if t.value is not None else S.FAILED
            if t.value is None:
                t.error = f"no {self.spec.metric} in MLflow or in the output"
            else:  # its place in the session's ranking, for checkpoint retention (orchestrator.service.retention)
                self.store.keeping.set_scores({job.id: self.spec.direction.score(t.value)})
        elif job.state == "FAILED":
            t.status = S.FAILED
            timed_out = job.timed_out  # the queue stopped it at the program's time_limit
            t.error = TIME_LIMIT if timed_out else f"exit code {job.exit_code}: {job.reason}"[:300]
        else:
            t.status, t.error = S.CANCELLED, job.reason[:300]
        if t.status is S.FAILED:
            t.log_tail = tail
        t.device_s = device_seconds(self.store, job)
        self.tracker.finish(t.run_id, run_status(t.status.value))
        self._cleanup.append(self._worktree(t))  # removed after this pass's submissions: devices first
        self._save(t)
        if t.kind is not Kind.RERUN:
            self.say(f"trial {t.n} {t.status.value}: " + (f"{self.spec.metric} {t.value:.5g}"
                                                          if t.value is not None else t.error))

    def _metric(self, t: ProgramTrial, job: Any) -> float | None:
        """The run's metric: from MLflow (a program using the runtime), else the output lines its wrapper read,
        which are then logged to the run so MLflow shows them too."""
        value = self.tracker.final(t.run_id, self.spec.metric)
        if value is not None:
            return value
        reports = outputmetrics.read(job.checkpoint_dir)
        for step, v in reports:
            self.tracker.log_metrics(t.run_id, {self.spec.metric: v}, step=step)
        return reports[-1][1] if reports else None

    # -- proposing -------------------------------------------------------------------------------------------------

    def _fill(self) -> None:
        """Collect the model's answer when it is in; ask for the next step when slots are free.

        The model thinks in a background thread while this loop keeps recording runs and queueing re-runs, and
        one trial more than there are slots waits in the queue, so a device never waits for the model."""
        if self._asking is not None:
            future, step = self._asking
            if not future.done():
                return
            self._asking = None
            try:
                variants, reasons = future.result()
            except Exception as exc:  # an unexpected failure of the endpoint or of git: counted, not fatal
                variants, reasons = [], [f"{type(exc).__name__}: {exc}"]
            self._take(step, variants, reasons)
        if self.state["stop_reason"] or self._time_up():
            return
        if self._asking is not None:
            return
        free = self.parallel + 1 - sum(1 for t in self.trials if t.status in ACTIVE)
        left = self._left()
        room = free if left is None else min(free, left // self.spec.repeats)
        if room <= 0:
            return
        if self.state["pending_debug"]:
            crashed = self.trials[self.state["pending_debug"][0]]  # dropped from the list once answered
            step = answers.Step("debug", crashed.commit, self._files(crashed.commit), 1,
                                log_tail=crashed.log_tail or "")
        else:
            best = self.trials[self.state["incumbent"]]
            kind = "draft" if self.state["drafts_left"] > 0 else "improve"
            step = answers.Step(kind, best.commit, self._files(best.commit), room, note=self.state["note"])
        commits = [t.commit for t in tree.nodes(self.trials) if t.commit]
        self._asking = (self._pool.submit(
            propose.ask, self.llm, goal=self.cfg.goal, spec=self.spec, step=step, history=self._history(),
            best=self._best_line(), resolve=lambda ref: _resolve(commits, ref), read=self._read,
            tried=self._tried(), max_reasks=self.cfg.max_reasks), step)

    def _take(self, step: answers.Step, variants: list, reasons: list[str]) -> None:
        """Record and submit the variants of one answered step (or count a step that gave none)."""
        self._usage()
        pending = self.state["pending_debug"]
        if step.kind == "debug" and pending and self.trials[pending[0]].commit == step.parent:
            pending.pop(0)  # answered (a crash before this point asks again on resume)
        if not variants:
            self.state["rejected"] += 1
            self.say(f"no usable proposal after {self.cfg.max_reasks} re-ask(s): {reasons[-1] if reasons else ''}")
            self.judge.govern("failed")
            return
        for v in variants:
            parent = next(t for t in tree.nodes(self.trials) if t.commit == v.parent)
            t = tree.new_trial(self.sid, len(self.trials), kind=Kind.VARIANT, step=v.kind, parent=v.parent,
                               parent_node=parent.n, rationale=v.rationale, edits=v.edits,
                               depth=parent.depth + 1 if v.kind == "debug" else 0)
            t.files, t.fingerprint = v.files, propose.fingerprint(v.files)
            self._add(t)
            if v.kind == "draft":
                self.state["drafts_left"] = max(0, self.state["drafts_left"] - 1)

    def _files(self, commit: str) -> dict[str, str]:
        return {f: self._read(commit, f) or "" for f in self.spec.edit}

    def _read(self, commit: str, file: str) -> str | None:
        return self.repo.show(commit, self.spec.repo_path(file))

    def _tried(self) -> set:
        own = {(t.parent, t.fingerprint) for t in tree.nodes(self.trials) if t.kind is Kind.VARIANT}
        return own | self.memory.tried

    def _history(self) -> list[str]:
        own = tree.history_lines(self.trials)
        return [*own, "", *self.memory.lines] if self.memory.lines else own

    def _best_line(self) -> str:
        return tree.best_line(self.trials, self.state["incumbent"], self.spec.metric)

    def _usage(self) -> None:
        usage = self.state["usage"]
        for k, v in self.llm.take_usage().items():
            usage[k] = usage.get(k, 0) + v
        if usage:
            self.on_usage(dict(usage))  # in all so far: `usage` shows a running session's spend


def _take_files(t: ProgramTrial) -> dict[str, str]:
    """A variant's new file texts, taken off the trial for its commit (a variant is recorded with them)."""
    files, t.files = t.files, None
    if files is None:  # a variant is saved with its files until its commit exists: a row broken by hand
        raise ValueError(f"trial {t.n} has neither a commit nor the files to make it from")
    return files


def _resolve(commits: list[str], ref: str) -> str | None:
    """The session commit a proposal's parent names (a prefix of at least 4 hex digits), or None."""
    ref = ref.strip().lower()
    return next((c for c in commits if c.startswith(ref)), None) if len(ref) >= 4 else None
