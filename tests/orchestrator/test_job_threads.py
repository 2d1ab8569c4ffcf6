"""A job's CPU threads: its part of the host's cores, set where its libraries look (OMP_NUM_THREADS,
MKL_NUM_THREADS) and applied to torch whether the job starts cold or forked warm; a job's own count wins."""

from __future__ import annotations

import json
import os
import sys
import types

import pytest

from orchestrator.api import jobs as api
from orchestrator.core.config import Settings
from orchestrator.executors.base import cpu_threads
from orchestrator.queue.models import JobSpec
from tests.orchestrator.helpers import started, wait_for


def _job(devices, gpus=1, share=None):
    return types.SimpleNamespace(devices=devices, gpus=gpus, gpu_share=share,
                                 shares_gpu=share is not None and share < 1)


def test_threads_follow_the_part_of_the_host_a_job_holds():
    gpus = ["0", "1"]
    assert cpu_threads(_job(["0"]), gpus, 16) == 8  # one of two GPUs: half the cores
    assert cpu_threads(_job(["0", "1"], gpus=2), gpus, 16) == 16
    assert cpu_threads(_job(["0"], share=0.25), gpus, 16) == 2  # a quarter of one of two GPUs
    assert cpu_threads(_job(["0"], share=1 / 16), ["0"], 8) == 1  # never none
    slots = ["cpu:0", "cpu:1"]
    assert cpu_threads(_job(["cpu:0"]), slots, 2) == 1
    assert cpu_threads(_job(["cpu:0"]), ["cpu:0"], 2) == 2
    # On a cpu slot the threads are the work: a share gets the whole slot's, so a packed trial computes what
    # it computes alone.
    assert cpu_threads(_job(["cpu:0"], share=0.25), ["cpu:0"], 2) == 2


PROBE = ("import json, os, sys, torch\njson.dump({'omp': os.environ.get('OMP_NUM_THREADS'), "
         "'mkl': os.environ.get('MKL_NUM_THREADS'), 'torch': torch.get_num_threads()}, open(sys.argv[1], 'w'))\n")


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_a_job_gets_its_threads_cold_or_warm_and_its_own_count_wins(home, tmp_path, monkeypatch, warm):
    from orchestrator.service.daemon import Service

    monkeypatch.setenv("AUTORESEARCH_PREFLIGHT", "off")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setenv("AUTORESEARCH_WARM", "1" if warm else "0")
    monkeypatch.setenv("AUTORESEARCH_WARM_PRELOAD", "torch")
    # Two slots: each job's part is half the cores, fewer than torch's default of one thread per core (what a
    # warm job would keep from its pool without being told).
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    service = Service(Settings.load(), devices="cpu:2", preempt_after=0, tick=0.2).start()
    try:
        if warm:
            assert service.executor.warm_pool.wait_ready(120)
        seen = {}
        for name, env in (("given", {}), ("own", {"OMP_NUM_THREADS": "1"})):
            out = tmp_path / f"{name}.json"
            job_id = api.submit(JobSpec(argv=[sys.executable, str(probe), str(out)], env=env, track=False))[0].id
            wait_for(lambda: service.store.get(job_id).state in ("SUCCEEDED", "FAILED"), timeout=120, what=name)
            assert service.store.get(job_id).state == "SUCCEEDED", open(service.store.get(job_id).log_path).read()
            how = started(service.store, job_id)[0]
            assert how.endswith(", warm") == warm, how
            seen[name] = json.loads(out.read_text())
    finally:
        service.stop()
    assert seen["given"] == {"omp": str(threads), "mkl": str(threads), "torch": threads}
    assert seen["own"]["omp"] == "1" and seen["own"]["torch"] == 1 and seen["own"]["mkl"] is None
