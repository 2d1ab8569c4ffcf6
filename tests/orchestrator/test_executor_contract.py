"""One contract for every executor: the same scenarios pass on the local executor (its attempts forked warm
from its pool, and started cold), on a real Ray cluster and on a real Slurm cluster.

The Ray cluster is a local head started once for the session (`ray start --head` on free ports, 2 CPUs and
2 logical GPUs); it is skipped with a reason when Ray is not installed. Services run in-process on cpu:2
slots (one Ray CPU per slot), except the GPU-inventory test, which uses the cluster's logical GPUs. The
Slurm cluster is the one-host cluster `.ci/slurm-setup.sh` starts (one Slurm CPU per slot); without it the
Slurm cases skip with the reason (and fail under CI).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from orchestrator.api import jobs as api
from orchestrator.core.config import Settings
from orchestrator.executors.base import Liveness
from orchestrator.queue.models import JobSpec
from orchestrator.queue.states import HOLDING
from tests.support.requires import require
from tests.orchestrator.helpers import SCRIPTS, ckpt_job, kill_leftovers, started, wait_for
from tests.support.dispatch import wait_for_dispatch


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def needs_ray() -> None:
    """Ray's job client: skipped where the `ray` extra is not installed, a failure under CI (which installs it)."""
    import importlib.util

    require("Ray", None if importlib.util.find_spec("ray") and importlib.util.find_spec("ray.job_submission")
            else "not installed (pip install 'autoresearch[ray]')")


@pytest.fixture(scope="module")
def ray_head():
    """The dashboard address of a local Ray head (2 CPUs, 2 logical GPUs) for this module's Ray tests (one xdist
    group, so they run together): it stops when the worker moves on, since an idle head costs about 4% of a core."""
    needs_ray()
    ray_bin = Path(sys.executable).with_name("ray")
    require("the `ray` command", None if ray_bin.exists() else f"none next to {sys.executable}")
    temp = tempfile.mkdtemp(prefix="rayt-", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    dash = free_port()
    ports = ["--port", free_port(), "--dashboard-port", dash, "--ray-client-server-port", free_port(),
             "--dashboard-agent-listen-port", free_port(), "--dashboard-agent-grpc-port", free_port(),
             "--metrics-export-port", free_port(), "--runtime-env-agent-port", free_port(),
             "--node-manager-port", free_port(), "--object-manager-port", free_port()]
    cmd = [str(ray_bin), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
           "--dashboard-host", "127.0.0.1", "--include-dashboard", "true", "--num-cpus", "2", "--num-gpus", "2",
           "--temp-dir", temp, "--disable-usage-stats", *map(str, ports)]
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    out = open(Path(temp) / "head.log", "wb")
    # `ray start --block` owns every process of the head and takes them down on SIGTERM: stopping it stops
    # only this cluster (`ray stop` would stop every Ray on the machine).
    head = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    try:
        from ray.job_submission import JobSubmissionClient

        def up():
            if head.poll() is not None:
                raise RuntimeError(f"ray start exited: {(Path(temp) / 'head.log').read_text()[-2000:]}")
            try:
                JobSubmissionClient(address).list_jobs()
                return True
            except Exception:
                return False

        wait_for(up, timeout=90, interval=0.5, what="the Ray head")
        yield address
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        out.close()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_cluster():
    """The node of the one-host Slurm cluster (skips, or fails under CI, when there is none)."""
    from tests.support.slurm import slurm_node

    return slurm_node()


@pytest.fixture(params=["local", "local-cold", "ray", "slurm"])
def kind(request):
    """The executor under test; `local` forks Python attempts from its warm pool, `local-cold` does not."""
    return request.param


@pytest.fixture
def start_service(home, kind, request, monkeypatch):
    """start_service(devices="cpu:2"): an in-process service with the executor under test, on this home."""
    from orchestrator.service.daemon import Service

    # Device preflight (tested with the health module) imports torch at the first start: seconds per test.
    monkeypatch.setenv("AUTORESEARCH_PREFLIGHT", "off")
    monkeypatch.setenv("AUTORESEARCH_WARM", "0" if kind == "local-cold" else "1")
    # The pool's imports are the runtime's context only: how it forks is under test, not torch's seconds.
    monkeypatch.setenv("AUTORESEARCH_WARM_PRELOAD", "runtime.context")
    executor = "local" if kind.startswith("local") else kind

    address = request.getfixturevalue("ray_head") if kind == "ray" else None
    if kind == "slurm":
        request.getfixturevalue("slurm_exclusive")
        request.getfixturevalue("slurm_cluster")
    started = []

    def start(devices="cpu:2"):
        settings = Settings.load(devices=devices, executor=executor)
        if address:
            settings.extra["ray_address"] = address
        service = Service(settings, devices=devices, executor=executor, preempt_after=0, tick=0.2).start()
        started.append(service)
        if kind == "local":  # (its pool starts with the first Python attempt: here, before any)
            assert service.executor.warm_pool.wait_ready(60)
        return service

    yield start
    for service in started:
        if service._home_lock.fh is None:
            continue
        if kind == "ray":  # stop what the test left running on the cluster
            for job in service.store.list(HOLDING):
                service.executor.stop(job)
        elif kind == "slurm":
            for job in service.store.list(HOLDING):
                service.executor.signal(job, signal.SIGKILL)
        else:
            kill_leftovers(service.store)
        service.stop()


def local_service(request, kind, warm_only=False):
    """`start_service`, for a local kind only (skipped before a cluster is asked for)."""
    if not kind.startswith("local") or (warm_only and kind != "local"):
        pytest.skip("the warm pool's choice" if warm_only else "how the local executor starts an attempt")
    return request.getfixturevalue("start_service")


def state(service, job_id):
    return service.store.get(job_id).state


def log_of(service, job_id) -> str:
    path = service.store.get(job_id).log_path
    return Path(path).read_text(errors="replace") if path and os.path.exists(path) else ""


def submit(spec: JobSpec) -> int:
    return api.submit(spec)[0].id


def test_exit_codes_retries_and_exit_75(start_service, tmp_path):
    service = start_service()
    env_out = tmp_path / "env"
    ok = submit(JobSpec(argv=["sh", "-c", f'echo "$AUTORESEARCH_JOB_ID:$AUTORESEARCH_ATTEMPT:'
                                          f'[$CUDA_VISIBLE_DEVICES]:$FOO" > {env_out}; echo hello'],
                        env={"FOO": "bar"}, track=False))
    bad = submit(JobSpec(argv=["sh", "-c", "exit 3"], track=False))
    temp = submit(JobSpec(argv=["sh", "-c", 'test "$AUTORESEARCH_ATTEMPT" -ge 2 || exit 75'], track=False))
    done = ("SUCCEEDED", "FAILED", "CANCELLED")
    wait_for(lambda: all(state(service, j) in done for j in (ok, bad, temp)), timeout=60, what="three jobs")
    assert (state(service, ok), service.store.get(ok).exit_code) == ("SUCCEEDED", 0)
    assert env_out.read_text().strip() == f"{ok}:1:[]:bar"  # the job protocol's env and overrides reach the job
    assert "hello" in log_of(service, ok)
    assert (state(service, bad), service.store.get(bad).exit_code) == ("FAILED", 3)
    job = service.store.get(temp)
    assert (job.state, job.attempts, job.failures) == ("SUCCEEDED", 2, 0)  # 75: requeued, no attempt spent


def test_a_warm_start_is_a_cold_start_to_the_job(request, kind, tmp_path):
    # A service started ignoring SIGINT (a shell's background job, `autoresearch serve &` in a script) starts its
    # jobs with SIGINT at its default all the same, warm or cold: its spawner and pool start ignoring it here.
    ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        service = local_service(request, kind)()
        probe = str(SCRIPTS / "start_probe.py")
        as_file = submit(JobSpec(argv=[sys.executable, probe, "75"], cwd=str(tmp_path), env={"FOO": "bar"},
                                 track=False))
        as_module = submit(JobSpec(argv=[sys.executable, "-m", "start_probe", "4"], cwd=str(SCRIPTS), track=False))
        wait_for(lambda: all(state(service, j) in ("SUCCEEDED", "FAILED") for j in (as_file, as_module)),
                 timeout=60)
    finally:
        signal.signal(signal.SIGINT, ignored)
    # What a fresh interpreter has, started as a terminal starts one (SIGINT at its default, whatever this test
    # process was started with): the reference for the signals, the mask, the threads and stdin.
    shell = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
    fresh = json.loads(subprocess.run([sys.executable, "-c", shell, sys.executable, probe, "0"],
                                      stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                      start_new_session=True).stdout)
    job = service.store.get(as_file)
    assert (job.state, job.attempts, job.failures) == ("SUCCEEDED", 2, 0)  # 75: requeued, no attempt spent
    assert (state(service, as_module), service.store.get(as_module).exit_code) == ("FAILED", 4)
    how = "warm" if kind == "local" else "cold: warm starts are off (AUTORESEARCH_WARM=0)"
    assert started(service.store, as_file) == [f"pid {p}, {how}" for p in _pids(service, as_file)]
    text = log_of(service, as_file)
    reports = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    assert len(reports) == 2 and text.count("probe-stderr") == 2  # stdout and stderr of each attempt
    report = reports[-1]
    assert report["argv"] == [probe, "75"] and report["name"] == "__main__" and report["main_file"] == probe
    assert report["spec"] is None and report["cwd"] == str(tmp_path) and report["path0"] == str(SCRIPTS)
    assert report["own_session"]  # its wrapper leads a session of its own, and the job is in it
    assert report["contract"] == {"AUTORESEARCH_JOB_ID": str(as_file), "AUTORESEARCH_ATTEMPT": "2",
                                  "AUTORESEARCH_CHECKPOINT_DIR": job.checkpoint_dir, "AUTORESEARCH_PARAMS": "{}",
                                  "CUDA_VISIBLE_DEVICES": "", "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "FOO": "bar"}
    assert report["proc_environ_matches"] and report["wrapper_vars"] == []  # /proc shows the job's environment
    for key in ("handlers", "blocked", "threads", "stdin"):
        assert report[key] == fresh[key], key
    if service.executor.tracking == "cgroup":
        assert report["cgroup"][0].endswith(f"/{as_file}.2")
    module = json.loads(next(line for line in log_of(service, as_module).splitlines() if line.startswith("{")))
    assert module["argv"] == [probe, "4"] and module["spec"] == "start_probe" and module["path0"] == str(SCRIPTS)


def _pids(service, job_id) -> list[int]:
    return [int(e.reason.split()[1].rstrip(",")) for e in service.store.events(job_id) if e.dst == "RUNNING"]


def test_a_job_the_pool_cannot_honour_starts_cold_and_show_says_why(request, kind, tmp_path, monkeypatch):
    start = local_service(request, kind, warm_only=True)
    extra = tmp_path / "warm_extra.py"
    extra.write_text("")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("AUTORESEARCH_WARM_PRELOAD", "runtime.context,warm_extra")
    service = start()
    probe = str(SCRIPTS / "start_probe.py")
    why = {submit(JobSpec(argv=[sys.executable, "-u", probe, "0"], track=False)): "cold: interpreter options (-u)",
           submit(JobSpec(argv=[sys.executable, probe, "0"], env={"OPENBLAS_NUM_THREADS": "3"}, track=False)):
               "cold: its environment sets OPENBLAS_NUM_THREADS otherwise than the warm pool's",
           submit(JobSpec(argv=["sh", "-c", "exit 0"], track=False)): "cold: sh is not a Python interpreter",
           submit(JobSpec(argv=[sys.executable, probe, "0"], cwd=str(tmp_path), track=False)): "warm"}
    wait_for(lambda: all(state(service, j) == "SUCCEEDED" for j in why), timeout=60, what="four jobs")
    for job_id, reason in why.items():
        assert started(service.store, job_id)[0].endswith(f", {reason}")
    os.utime(extra)  # a module the pool imported changed: the pool is stale
    changed = submit(JobSpec(argv=[sys.executable, probe, "0"], track=False))
    wait_for(lambda: state(service, changed) == "SUCCEEDED", timeout=60)
    assert started(service.store, changed)[0].endswith(", cold: the environment changed since the warm pool started")
    assert service.executor.warm_pool.wait_ready(60)  # a new pool, with the module as it is now
    again = submit(JobSpec(argv=[sys.executable, probe, "0"], track=False))
    wait_for(lambda: state(service, again) == "SUCCEEDED", timeout=60)
    assert started(service.store, again)[0].endswith(", warm")


def test_a_config_file_experiment_runs_its_python_script_warm(request, kind, tmp_path):
    (tmp_path / "train.py").write_text("import sys\nprint('preloaded', 'runtime.context' in sys.modules, sys.argv[1:])"
                                       "\nprint('val_loss: 0.5')\n")
    (tmp_path / "autoresearch.toml").write_text('[experiment]\nrun = "python train.py {args}"\nmetric = "val_loss"\n'
                                                'direction = "minimize"\n[space]\nlr = { type = "float", '
                                                'low = 0.001, high = 0.1, default = 0.01 }\n')
    service = local_service(request, kind)()
    job_id = submit(api.experiment_spec(str(tmp_path), {"lr": 0.02}, track=False))
    wait_for(lambda: state(service, job_id) in ("SUCCEEDED", "FAILED"), timeout=60, what="the experiment's run")
    text = log_of(service, job_id)
    assert state(service, job_id) == "SUCCEEDED" and "preloaded" in text
    warm = kind == "local"  # its wrapper forked from the pool, and the script from the wrapper
    assert text.count("(warm)") == int(warm) and f"preloaded {warm} ['--lr=0.02']" in text


def test_a_run_command_is_read_as_sh_reads_it_warm_or_cold(request, kind, tmp_path):
    """Leading assignments, `$VARS` and quotes in `run`: the script sees what /bin/sh gives it, whether it
    is forked from the warm pool or started through the shell."""
    (tmp_path / "train.py").write_text(
        "import json, os, sys\nprint('saw', json.dumps([sys.argv[1:], os.environ.get('OMP_NUM_THREADS'), "
        "os.environ.get('GREETING'), os.environ.get('AUTORESEARCH_JOB_ID')]))\nprint('val_loss: 0.5')\n")
    run = """OMP_NUM_THREADS=3 GREETING='hi there' python train.py --id=$AUTORESEARCH_JOB_ID "two words" {args}"""
    (tmp_path / "autoresearch.toml").write_text(f'[experiment]\nrun = {json.dumps(run)}\nmetric = "val_loss"\n'
                                                'direction = "minimize"\n[space]\nlr = { type = "float", '
                                                'low = 0.001, high = 0.1, default = 0.01 }\n')
    service = local_service(request, kind)()
    job_id = submit(api.experiment_spec(str(tmp_path), {"lr": 0.02}, track=False))
    wait_for(lambda: state(service, job_id) in ("SUCCEEDED", "FAILED"), timeout=60, what="the experiment's run")
    text = log_of(service, job_id)
    assert state(service, job_id) == "SUCCEEDED", text
    saw = json.loads(text.split("saw ", 1)[1].splitlines()[0])
    assert saw == [[f"--id={job_id}", "two words", "--lr=0.02"], "3", "hi there", str(job_id)]
    assert text.count("(warm)") == int(kind == "local")


def test_cancel_queued_and_running_and_sigkill_after_grace(start_service):
    service = start_service("cpu:2")
    running = submit(ckpt_job(1000))
    stubborn = submit(JobSpec(argv=["sh", "-c", "trap '' TERM; echo up; sleep 60"], grace=1, track=False))
    queued = submit(ckpt_job(1000))
    wait_for(lambda: "starts at step" in log_of(service, running) and "up" in log_of(service, stubborn),
             timeout=60, what="both jobs to start")
    assert api.cancel(queued).state == "CANCELLED"
    assert api.cancel(running).state == "CANCELLING"
    api.cancel(stubborn)
    wait_for(lambda: state(service, running) == "CANCELLED", timeout=30, what="the cancel")
    job = service.store.get(running)
    assert job.exit_code == 143 and "checkpointed" in log_of(service, running)  # it checkpointed on SIGTERM
    wait_for(lambda: state(service, stubborn) == "CANCELLED", timeout=20, what="SIGKILL after the grace")
    assert service.store.get(stubborn).exit_code in (-signal.SIGKILL, 128 + signal.SIGKILL)


def test_preemption_checkpoints_requeues_and_resumes(start_service):
    service = start_service("cpu:2")
    low = [submit(ckpt_job(400, priority=0, name=f"low{i}")) for i in range(2)]
    wait_for(lambda: all("starts at step" in log_of(service, j) for j in low), timeout=60, what="low jobs")
    high = submit(ckpt_job(10, priority=50, name="high"))
    wait_for(lambda: state(service, high) == "SUCCEEDED", timeout=60, what="the high job")
    victims = [j for j in low if service.store.get(j).preemptions == 1]
    assert len(victims) == 1
    victim = victims[0]
    events = [(e.src, e.dst) for e in service.store.events(victim)]
    assert ("RUNNING", "PREEMPTING") in events and ("PREEMPTING", "QUEUED") in events
    text = wait_for(lambda: "attempt 2 starts" in log_of(service, victim) and log_of(service, victim),
                    timeout=60, what="the victim to resume")
    assert "checkpointed at step" in text.split("attempt 2 starts")[0]
    assert int(text.split("attempt 2 starts at step ")[1].split()[0]) > 0  # resumed from its marker
    for job_id in low:
        service.store.cancel(job_id)
    wait_for(lambda: all(state(service, j) == "CANCELLED" for j in low), timeout=30)


def test_multi_slot_job_is_all_or_nothing(start_service):
    service = start_service("cpu:2")
    blocker = submit(ckpt_job(1000, priority=0, preemptible=False))
    wait_for(lambda: "starts at step" in log_of(service, blocker), timeout=60)
    # One write(2) per rank: both ranks share the log, and print() may split a line into several writes.
    code = "import os; os.write(1, f\"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}\\n\".encode())"
    pair = submit(JobSpec(argv=[sys.executable, "-c", code], gpus=2, priority=20, track=False))
    wait_for_dispatch(service)
    assert state(service, pair) == "QUEUED"  # one free slot is not enough
    api.cancel(blocker)
    wait_for(lambda: state(service, pair) == "SUCCEEDED", timeout=120, what="the two-slot job")
    assert sorted(service.store.get(pair).devices) == ["cpu:0", "cpu:1"]
    text = log_of(service, pair)
    assert "rank 0 of 2" in text and "rank 1 of 2" in text


def test_adoption_after_service_restart(start_service, tmp_path):
    service = start_service("cpu:2")
    gate = tmp_path / "gate"
    # Runs until the test opens its gate, which happens only once the next service has started (and so has
    # already adopted or settled it): its "finished" proves it was still running when it was adopted.
    # Its words are split in its command line (which heads the log), so only its output contains them.
    script = f"printf 'wait%s\\n' ing; while [ ! -e {gate} ]; do sleep 0.05; done; printf 'fin%s\\n' ished"
    long_id = submit(JobSpec(argv=["sh", "-c", script], track=False))
    # Ends while no service runs (once the test opens its own gate, after the service stopped); prints a word
    # found neither in its command line nor in a path (the log's header shows both).
    short_gate = tmp_path / "short-gate"
    short = f"printf 'q7z%s\\n' x4k; while [ ! -e {short_gate} ]; do sleep 0.05; done; exit 4"
    short_id = submit(JobSpec(argv=["sh", "-c", short], track=False))
    wait_for(lambda: "q7zx4k" in log_of(service, short_id) and "waiting" in log_of(service, long_id),
             timeout=90, what="both jobs to start")
    service.stop()  # running jobs keep running
    short_gate.touch()
    # The executor (its probe needs no running service) can tell the short job ended, and how: only then
    # does the next service start, so it finds an ended job rather than adopting a running one.
    wait_for(lambda: service.executor.probe(service.store.get(short_id)).state is Liveness.ENDED,
             timeout=30, what="the short job to end while no service runs")
    assert state(service, short_id) == "RUNNING"  # nobody recorded its end yet
    again = start_service("cpu:2")
    wait_for(lambda: state(again, short_id) == "FAILED", timeout=30, what="the ended job to be recorded")
    assert again.store.get(short_id).exit_code == 4
    assert state(again, long_id) == "RUNNING" and "finished" not in log_of(again, long_id)
    gate.touch()
    wait_for(lambda: state(again, long_id) == "SUCCEEDED", timeout=60, what="the adopted job to finish")
    job = again.store.get(long_id)
    assert job.attempts == 1 and job.exit_code == 0 and log_of(again, long_id).count("finished") == 1
    assert log_of(again, short_id).count("q7zx4k") == 1  # the log mirror does not repeat itself on adoption


def test_ray_inventory_is_the_clusters_gpus(ray_head, home, tmp_path, monkeypatch):
    from orchestrator.service.daemon import Service

    # The service's local device preflight cannot check GPUs on other nodes (it reads `ray:N` as a local
    # index); this test is about Ray's placement, so it runs without it.
    monkeypatch.setenv("AUTORESEARCH_PREFLIGHT", "off")

    settings = Settings.load(devices="auto", executor="ray")
    settings.extra["ray_address"] = ray_head
    service = Service(settings, executor="ray", preempt_after=0, tick=0.2).start()
    try:
        assert service.device_names == ["ray:0", "ray:1"]
        out = tmp_path / "cuda"
        ids = [submit(JobSpec(argv=["sh", "-c", f'echo "$CUDA_VISIBLE_DEVICES" >> {out}; sleep 2'],
                              track=False)) for _ in range(2)]
        wait_for(lambda: all(state(service, j) == "SUCCEEDED" for j in ids), timeout=60)
        assert sorted(out.read_text().split()) == ["0", "1"]  # Ray assigned one logical GPU to each
        # `autoresearch logs` on a host without the mirrored log file reads the output from Ray.
        job = service.store.get(ids[0])
        assert "exit code 0" in Path(job.log_path).read_text()
        os.unlink(job.log_path)
        cli = Path(sys.executable).with_name("autoresearch")
        shown = subprocess.run([str(cli), "logs", str(ids[0])], capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0 and "=== autoresearch: exit code 0" in shown.stdout, shown.stderr
    finally:
        service.stop()


def test_ray_needs_an_address(home, monkeypatch):
    needs_ray()
    from orchestrator.core.errors import BadInput
    from orchestrator.executors.ray.executor import RayExecutor

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(BadInput, match="--ray-address"):
        RayExecutor(Settings.load(devices="cpu:1"), lambda _exit: None)
    with pytest.raises(BadInput, match="cannot reach the Ray cluster"):
        RayExecutor(Settings.load(devices="cpu:1"), lambda _exit: None, address=f"127.0.0.1:{free_port()}")


def test_reaper_stops_a_lost_hosts_ray_job_before_requeueing_it(ray_head, tmp_path):
    """A service that ran a Ray job died: the job still runs on the cluster, so the reaper stops it through
    the Jobs API first and requeues it only once Ray says it ended."""
    from ray.job_submission import JobSubmissionClient
    from sqlmodel import Session

    from orchestrator.service.reaper import reap_dead_hosts
    from orchestrator.executors.ray.executor import RayExecutor
    from orchestrator.queue.models import ServiceRecord
    from orchestrator.queue.store import JobStore

    store = JobStore(f"sqlite:///{tmp_path / 'q.db'}")
    job_id = store.submit(JobSpec(argv=["sleep", "60"], track=False)).id
    store.claim([(job_id, ["cpu:0"])], "lost")
    client = JobSubmissionClient(ray_head)
    sid = client.submit_job(entrypoint="sleep 60", entrypoint_num_cpus=1,
                            runtime_env={"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "1"}})
    wait_for(lambda: str(client.get_job_status(sid)) in ("RUNNING", "JobStatus.RUNNING"), timeout=60)
    store.mark_running(job_id, 0, f"ray:{sid}@{ray_head}", "lost")
    store.hosts.heartbeat("lost", 1, str(tmp_path), ["cpu:0"], 0.0)
    with Session(store.db.engine) as session:
        rec = session.get(ServiceRecord, "lost")
        rec.heartbeat_at = time.time() - 60
        session.add(rec)
        session.commit()
    executor = RayExecutor(Settings.load(devices="cpu:1"), lambda _exit: None, address=ray_head)
    try:
        assert reap_dead_hosts(store, "live", 10, executor) == []  # still running on the cluster: stopped
        assert store.get(job_id).state == "RUNNING"
        wait_for(lambda: client.get_job_status(sid).is_terminal(), timeout=30, what="Ray to stop the job")
        wait_for(lambda: reap_dead_hosts(store, "live", 10, executor), timeout=15, what="the reaper to settle it")
    finally:
        executor.close()
    job = store.get(job_id)
    assert job.state == "QUEUED" and "host lost lost" in job.reason and job.failures == 0


def test_the_warm_setting_turns_warm_starts_on_and_off(home, monkeypatch):
    from orchestrator.core.errors import BadInput

    assert Settings.load().warm is True  # the default
    for raw, value in (("0", False), ("off", False), ("1", True), ("on", True)):
        monkeypatch.setenv("AUTORESEARCH_WARM", raw)
        assert Settings.load().warm is value
    monkeypatch.setenv("AUTORESEARCH_WARM", "maybe")
    with pytest.raises(BadInput, match="AUTORESEARCH_WARM"):
        Settings.load()
