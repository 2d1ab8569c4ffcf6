"""A session's final report says how busy the GPUs were while its trials held them (from the service's samples)."""

from __future__ import annotations

from orchestrator.agent.report import gpu_use, markdown
from orchestrator.queue.gpuuse import GpuUse, JobStep
from orchestrator.queue.store import JobStore

SUMMARY = {"session": "s-0000beef", "experiment": "synthetic", "goal": "g", "proposer": "tpe", "stop_reason": "",
           "trials": 2, "elapsed_s": 1.0, "device_seconds": 2.0, "metric": "loss", "headline": "no improvement",
           "baseline": None, "verdict": None, "ranking": []}


def test_the_report_gives_the_busy_share_of_the_device_time_its_trials_held(home, capsys):
    from orchestrator.faces.cli.agent import _print_summary

    store = JobStore(f"sqlite:///{home / 'queue.db'}")
    # As the sampler records them: trial 1 held a whole GPU for an hour at 60%, trial 2 a quarter of one at 100%.
    GpuUse(store.db).record("h", {}, {}, {1: JobStep(3600, 3600, 2160, 10**9), 2: JobStep(3600, 900, 900, 10**9),
                                          3: JobStep(3600, 3600, 3600, 0)})
    trials = [{"job_id": 1}, {"job_id": 2}, {"job_id": None}]  # a trial that never got a job counts nothing
    gpu = gpu_use(store, trials)
    assert gpu == {"held_s": 4500.0, "busy_s": 3060.0,
                   "text": "GPU busy 68% of the device time it held (1.25 device-hours)"}
    assert "**GPU:** GPU busy 68% of the device time it held" in markdown({**SUMMARY, "gpu": gpu})
    _print_summary({**SUMMARY, "tally": "2 trials", "gpu": gpu})
    assert "GPU busy 68% of the device time it held" in capsys.readouterr().out


def test_a_session_on_cpu_slots_says_no_gpu_held_and_its_report_leaves_the_line_out(home, capsys):
    from orchestrator.faces.cli.agent import _print_summary

    store = JobStore(f"sqlite:///{home / 'queue.db'}")
    gpu = gpu_use(store, [{"job_id": 1}])
    assert gpu == {"held_s": 0.0, "busy_s": 0.0, "text": "no GPU held"}
    assert "GPU" not in markdown({**SUMMARY, "gpu": gpu})
    _print_summary({**SUMMARY, "tally": "1 trial", "gpu": gpu})
    assert "GPU" not in capsys.readouterr().out
