"""The local executor: each attempt runs in its own process session on this host.

A tiny `/bin/sh` wrapper leads the session. It joins the attempt's cgroup (when there is one), `cd`s to the
submit directory, runs the command in the foreground and records the exit code in a file before exiting
(`orchestrator.core.layout`). That record is what lets a restarted service (even after `kill -9`) tell how a job
it did not see finish ended: jobs are left running across a service restart and adopted, like slurmstepd
keeps jobs alive across a slurmctld restart. The wrapper's own variables are unset before the command runs,
so the job and its workers never see them (the wrapper's /proc environ keeps them: that is how a restarted
service finds it).

An attempt is its whole process tree (`procs.ProcessTree`: a cgroup v2 where writable, else the descendants
psutil saw), not its process group: torchrun puts each worker in a session of its own. Stops reach every
process of the tree, and a device is handed back only once none is left. Exits are watched with pidfds by
one selector thread (`executors.watch.ExitWatcher`) so a finished job frees its device at once.

The wrappers are started by small spawner processes (`executors.spawner`), not by the service's threads:
a start from the service cost it a third of its CPU a job, under the GIL its other threads wait for.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Optional, Sequence, Union

from orchestrator.executors import container
from orchestrator.executors.local import procs
from orchestrator.executors.base import (Executor, Launched, Liveness, OnExit, Probe, StartLost, describe,
                                         job_argv, refuse_multinode)
from orchestrator.executors.local.mps import MpsControl
from orchestrator.executors.local.spawner import Spawner, SpawnerGone
from orchestrator.executors.local.warmstart import COLD, WARM, WarmPool
from orchestrator.executors.local.watch import EXIT_FILE_VAR, ExitWatcher, Found, Watch, kill_all, scan
from orchestrator.core.layout import Layout
from orchestrator.queue.models import Job

CGROUP_VAR = "AUTORESEARCH_CGROUP"
Outcome = Union[Launched, Exception]
SHELL = "/bin/sh"
# `trap :` makes the shell outlive a SIGTERM long enough to record the job's exit code; a trap with a
# command is reset to the default in the child, so the job itself still gets the signal.
WRAPPER = ('ef=$' + EXIT_FILE_VAR + '; cg=$' + CGROUP_VAR + '; unset ' + EXIT_FILE_VAR + ' ' + CGROUP_VAR + '; '
           '[ -z "$cg" ] || { echo $$ > "$cg/cgroup.procs"; } 2>/dev/null; '
           'cd -- "$1" || exit 126; shift; trap : TERM INT; "$@"; rc=$?; printf "%s" "$rc" > "$ef"; exit $rc')


class LocalExecutor(Executor):
    """Runs attempts as local process trees and reports their exits through `on_exit`."""

    name = "local"

    def __init__(self, layout: Layout, on_exit: OnExit, *, cgroup: str = "auto",
                 container_engine: Optional[str] = None, warm: bool = True, mps: Optional[MpsControl] = None):
        self.layout = layout if isinstance(layout, Layout) else Layout(layout)
        self.container_engine = container_engine  # for --image jobs (executors.container), resolved per use
        self.layout.ensure()
        self.cgroups = procs.Cgroups.for_home(self.layout.home, cgroup)
        if self.cgroups is not None:
            self.cgroups.prune(keep_base=True)  # emptied attempt cgroups an earlier service could not remove
        self._log_dirs: set[Path] = set()  # folders of job logs made (or found) by this executor
        self._watcher = ExitWatcher(self.layout, self.cgroups, on_exit)
        self._spawner = Spawner()
        self._spawner.start()  # the first one: its start-up (an interpreter and psutil) overlaps the service's
        self.warm_pool = WarmPool(self.layout.run_dir, enabled=warm)  # (executors.local.warmstart)
        self.mps = mps  # `serve --mps`: the GPUs' MPS daemons, started; stopped by close() (executors.local.mps)

    @classmethod
    def create(cls, settings, layout: Layout, on_exit: OnExit) -> "LocalExecutor":
        mode = settings.cgroup
        mps = None
        if settings.mps:
            from orchestrator.core.devices import parse

            mps = MpsControl(layout.home, parse(settings.devices)).start()
        return cls(layout, on_exit, cgroup=mode, container_engine=settings.container_engine, warm=settings.warm,
                   mps=mps)

    @property
    def tracking(self) -> str:
        """How attempts' processes are tracked here: `cgroup` (v2) or `psutil` (descendants)."""
        return "cgroup" if self.cgroups is not None else "psutil"

    def launch(self, job: Job, env: dict[str, str]) -> Launched:
        outcome = self.launch_many([(job, env)])[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def launch_many(self, batch: Sequence[tuple[Job, dict[str, str]]], pool=None) -> list[Outcome]:
        """Start attempts: each is prepared here, the spawner processes start them all (one write of requests
        each), and each started one is watched. Outcomes in order: a handle, or why it did not start."""
        outcomes: list[Optional[Outcome]] = [None] * len(batch)
        prepared: dict[bool, list] = {False: [], True: []}  # cold and warm starts: (index, job, cgroup, request, how)
        for i, (job, env) in enumerate(batch):
            try:
                refuse_multinode(job, self.name)
                request, cgroup, how = self._request(job, env)
            except Exception as exc:  # reported as a failed start
                outcomes[i] = exc
                continue
            prepared["warm" in request].append((i, job, cgroup, request, how))
        for warm, starts in prepared.items():
            spawner = self.warm_pool if warm else self._spawner
            try:
                answers = spawner.spawn_many([request for *_, request, _ in starts])
            except Exception as exc:  # nothing was sent (a request it could not encode): none started
                answers = [exc] * len(starts)
            for (i, job, cgroup, _, how), answer in zip(starts, answers):
                try:
                    outcomes[i] = self._started(job, cgroup, answer, how)
                except Exception as exc:  # (the watch could not be set up: out of file descriptors)
                    outcomes[i] = exc
        return outcomes  # type: ignore[return-value]

    def _started(self, job: Job, cgroup: Optional[Path], answer, how: str = "") -> Outcome:
        """Watch an attempt the spawner answered for; its handle, or why it did not start."""
        if isinstance(answer, SpawnerGone):  # it may have started before the spawner stopped
            found = self._found_after_loss(job)
            if found is not None:
                return found
            # Not started: a spawner that died cost the job nothing; one stopped for hanging on the job's log
            # (a volume that hangs) spends an attempt, so such a job cannot hang the queue's starts for ever.
            return answer if answer.hung else StartLost(str(answer))
        if isinstance(answer, Exception):
            return answer
        pid, start = answer
        try:  # first: the spawner may reap it any time, and then its pid may be reused
            fd: Optional[int] = os.pidfd_open(pid)
        except ProcessLookupError:
            fd = None
        # After the pidfd: if the process at `pid` still is the one the spawner started, so is the pidfd's.
        proc = procs.same_process(pid, start)
        watch = Watch(job.id, job.attempts, pid, procs.ProcessTree(proc, cgroup))
        if proc is None:  # it has ended already
            if fd is not None:
                os.close(fd)
            self._watcher.settle(watch)
        else:
            self._watcher.watch(watch, fd)
        return Launched(pid, start, how)

    def _request(self, job: Job, env: dict[str, str]) -> tuple[dict, Optional[Path], str]:
        """What the spawner (or the warm pool) needs to start the attempt (its exit file, cgroup, log and
        checkpoint folders made ready here), the attempt's cgroup, and `warm` or `cold: why`."""
        exit_file = self.layout.exit_file(job.id, job.attempts)
        exit_file.unlink(missing_ok=True)
        cgroup = self.cgroups.create(job.id, job.attempts) if self.cgroups is not None else None
        env = dict(env)
        env.update(self._mps_env(job))
        env[EXIT_FILE_VAR] = str(exit_file)
        env[CGROUP_VAR] = str(cgroup or "")
        log_path = Path(job.log_path or self.layout.log_path(job.id))
        if log_path.parent not in self._log_dirs:  # one look per folder (every job's log is in one)
            log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_dirs.add(log_path.parent)
        if job.checkpoint_dir:
            os.makedirs(job.checkpoint_dir, exist_ok=True)
        cwd = job.cwd if job.cwd and os.path.isdir(job.cwd) else str(Path.home())
        if job.image:  # the container is the job's process: the wrapper runs the engine in the foreground
            log_path.touch()
            argv = container.run_argv(job, env, self.layout, container.engine_name(self.container_engine))
        else:
            argv = job_argv(job)
        header = (f"=== autoresearch: attempt {job.attempts} of job {job.id} on "
                  f"{','.join(job.devices) or '-'}: {describe(argv)}\n")
        request = {"argv": [SHELL, "-c", WRAPPER, "autoresearch-job", cwd, *argv], "env": env,
                   "log": str(log_path), "header": header}
        target, why = self.warm_pool.plan(argv, env, cwd, image=bool(job.image), gpus=job.gpus)
        if target is None:
            return request, cgroup, f"{COLD}: {why}"
        return {"warm": target, "cwd": cwd, "env": env, "log": str(log_path), "header": header}, cgroup, WARM

    def _mps_env(self, job: Job) -> dict[str, str]:
        """Under `serve --mps`, what makes a job sharing one GPU a client of that GPU's MPS daemon with its
        share (and memory limit); nothing for other jobs (whole GPUs, containers, no MPS)."""
        if self.mps is None or job.image or len(job.devices or []) != 1:
            return {}
        return self.mps.client_env(job.devices[0], job.gpu_share, job.gpu_memory)

    def _found_after_loss(self, job: Job) -> Optional[Launched]:
        """The attempt's handle when it started before the spawner stopped without answering (it is then
        watched like an adopted attempt), else None."""
        found = self.find_attempt(job)
        if found is None:
            return None
        job.pid, job.proc_start = found.pid or None, found.proc_start
        self.adopt(job)
        return found

    # ---- finding attempts ---------------------------------------------------------------------------------

    def _foreign(self, job: Job) -> bool:
        """Whether the job's handle is another executor's (e.g. `ray:SID@ADDRESS`): not ours to judge."""
        return job.is_remote

    def _tree(self, job: Job, layout: Layout) -> procs.ProcessTree:
        """The processes of the job's current attempt on this machine, from the watch, the recorded pid, the
        attempt's cgroup, or a wrapper whose environment names the attempt's exit file."""
        watch = self._watcher.get((job.id, job.attempts)) if layout == self.layout else None
        if watch is not None:
            return watch.tree
        leader = procs.same_process(job.pid, job.proc_start)
        cgroups = self.cgroups if layout == self.layout else procs.Cgroups.for_home(layout.home, "existing")
        cgroup = cgroups.path(job.id, job.attempts) if cgroups is not None else None
        cgroup = cgroup if cgroup is not None and cgroup.exists() else None
        if leader is not None:
            return procs.ProcessTree(leader, cgroup)
        # No leader to start from: look for the wrapper (its pid was never recorded) and for processes the
        # attempt left behind (their parents died, so no tree leads to them).
        found = scan(layout).get((job.id, job.attempts), Found())
        return procs.ProcessTree(found.wrapper, cgroup, extra=found.members)

    def probe(self, job: Job, layout: Optional[Layout] = None) -> Probe:
        layout = layout or self.layout
        if self._foreign(job):
            return Probe(Liveness.UNKNOWN, detail=f"handle {job.proc_start!r} belongs to another executor")
        tree = self._tree(job, layout)
        if tree.alive():
            leader = tree.leader if tree.leader is not None and procs.alive(tree.leader) else None
            found = Launched(leader.pid, procs.start_time(leader.pid)) if leader is not None else None
            return Probe(Liveness.RUNNING, found=found)
        code = layout.read_exit(job.id, job.attempts)
        if code is not None:
            return Probe(Liveness.ENDED, code, f"exit code {code}", found=Launched(0, None))
        return Probe(Liveness.GONE)

    def find_attempt(self, job: Job) -> Optional[Launched]:
        probe = self.probe(job)
        if probe.state is Liveness.RUNNING and probe.found is None:
            return Launched(0, None)  # only leftovers of the attempt live: adopt() settles them
        return probe.found

    def signal(self, job: Job, sig: int, layout: Optional[Layout] = None) -> None:
        if self._foreign(job):
            return
        layout = layout or self.layout
        engine = container.engine_for(job, self.container_engine)
        if engine is not None:  # a container: through the engine; its client and wrapper go only with a SIGKILL
            container.deliver(engine, container.container_name(layout.home, job.id, job.attempts), sig,
                              self._tree(job, layout).alive, job.grace)
            if sig != signal.SIGKILL:
                return
        self._tree(job, layout).signal(sig)

    def adopt(self, job: Job) -> bool:
        recorded = procs.same_process(job.pid, job.proc_start)
        tree = self._tree(job, self.layout)
        if recorded is not None and not tree.exact():  # ranks orphaned while nobody watched: by their env
            tree.add(scan(self.layout).get((job.id, job.attempts), Found()).members)
        # The wrapper, by its recorded pid or else by its environment (a pid recorded in another format).
        leader = tree.leader if tree.leader is not None and procs.alive(tree.leader) else None
        watch = Watch(job.id, job.attempts, leader.pid if leader is not None else job.pid or 0, tree)
        if leader is not None:
            self._watcher.watch(watch)
            return True
        engine = container.engine_for(job, self.container_engine)
        if engine is not None:  # its engine client is gone: nothing would remove the container (or stop its job)
            container.remove(engine, container.container_name(self.layout.home, job.id, job.attempts))
        self._watcher.settle(watch)
        return False

    def stop_strays(self, current: set[tuple[int, int]], grace: float = 10.0) -> list[int]:
        strays: dict[tuple[int, int], procs.ProcessTree] = {}
        for key, found in scan(self.layout).items():
            if key not in current:
                strays[key] = procs.ProcessTree(found.wrapper, self._cgroup_of(*key), extra=found.members)
        for key in (self.cgroups.attempts() if self.cgroups is not None else []):
            if key not in current and key not in strays:
                strays[key] = procs.ProcessTree(None, self._cgroup_of(*key))
        for key, tree in strays.items():
            tree.signal(signal.SIGTERM)
            threading.Thread(target=self._kill_after, args=(key, tree, grace), daemon=True).start()
        return sorted(job_id for job_id, _ in strays)

    def _kill_after(self, key: tuple[int, int], tree: procs.ProcessTree, grace: float) -> None:
        """SIGKILL what of a stray is left after the grace, until nothing is (`kill_all`: without a cgroup, a
        process the job started as the SIGTERM went out, orphaned to init by its dying parent, is in no tree
        and is found by the job's environment)."""
        deadline = time.monotonic() + grace
        while tree.alive() and time.monotonic() < deadline:
            time.sleep(0.25)
        kill_all(self.layout, key, tree)

    def _cgroup_of(self, job_id: int, attempt: int) -> Optional[Path]:
        if self.cgroups is None:
            return None
        path = self.cgroups.path(job_id, attempt)
        return path if path.exists() else None

    def forget(self, job_id: int, attempt: int) -> None:
        self.layout.exit_file(job_id, attempt).unlink(missing_ok=True)
        self._watcher.remove_cgroup(job_id, attempt)  # kernel time: off the dispatch pass

    def close(self) -> None:
        self._spawner.close()  # first: the answers still due are watched
        self.warm_pool.close()
        self._watcher.close()
        if self.mps is not None:  # after the watcher: a daemon whose clients still run is left for the next service
            self.mps.stop()

