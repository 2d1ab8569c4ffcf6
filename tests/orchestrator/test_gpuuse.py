"""The GPU busy share: the integration rules (pure), the records in a real SQLite queue database, and the
sampler reading a fake NVML at its edge."""

from __future__ import annotations

import pytest
from sqlalchemy import update

from orchestrator.queue.gpuuse import (GpuUse, Holder, MEMORY_USED_METRIC, Sample, busy_share, integrate,
                                       integrate_host, metrics, share_text)
from orchestrator.queue.models import Job, JobSpec
from orchestrator.queue.store import JobStore
from orchestrator.service.gpuwatch import GpuWatch
from runtime.nvml import Nvml
from runtime.protocol import UTILIZATION_METRIC
from tests.support.fake_nvml import FakeNvml

GiB = 2**30


# ---- the arithmetic ------------------------------------------------------------------------------------------

def test_a_step_is_the_mean_utilisation_of_its_two_samples_times_the_time_between():
    prev, cur = Sample(100.0, 50, 1 * GiB), Sample(102.0, 100, 3 * GiB)
    device, jobs = integrate(prev, cur, [Holder(7, 1.0, since=0.0)], max_gap=10)
    assert (device.seconds, device.busy, device.held, device.busy_held) == pytest.approx((2.0, 1.5, 2.0, 1.5))
    assert jobs[7].seconds == pytest.approx(2.0) and jobs[7].held == pytest.approx(2.0)
    assert jobs[7].busy == pytest.approx(1.5) and jobs[7].peak_memory == 3 * GiB


def test_an_idle_device_is_observed_but_neither_held_nor_busy_while_held():
    device, jobs = integrate(Sample(0.0, 40), Sample(4.0, 40), [], max_gap=10)
    assert (device.seconds, device.busy, device.held, device.busy_held) == pytest.approx((4.0, 1.6, 0.0, 0.0))
    assert jobs == {}


def test_a_job_counts_from_its_start_and_sharers_count_their_share():
    prev, cur = Sample(10.0, 80), Sample(12.0, 80)
    device, jobs = integrate(prev, cur, [Holder(1, 0.25, since=0.0), Holder(2, 0.5, since=11.5)], max_gap=10)
    assert device.held == pytest.approx(2.0) and device.busy_held == pytest.approx(1.6)
    assert (jobs[1].seconds, jobs[1].held, jobs[1].busy) == pytest.approx((2.0, 0.5, 0.4))
    assert (jobs[2].seconds, jobs[2].held, jobs[2].busy) == pytest.approx((0.5, 0.25, 0.2))
    # Each sharer's busy share is the device's utilisation while it held it, not a quarter of it.
    assert jobs[1].busy / jobs[1].held == pytest.approx(0.8) == jobs[2].busy / jobs[2].held


def test_nothing_is_counted_without_a_previous_sample_or_across_a_gap_but_peak_memory_is():
    for prev in (None, Sample(0.0, 100), Sample(50.0, 100)):  # none, a gap over max_gap, not before `cur`
        device, jobs = integrate(prev, Sample(50.0, 100, 5 * GiB), [Holder(3)], max_gap=10)
        assert (device.seconds, device.busy, device.held) == (0, 0, 0)
        assert (jobs[3].seconds, jobs[3].held, jobs[3].peak_memory) == (0, 0, 5 * GiB)


def test_utilisation_out_of_range_is_clamped():
    device, _ = integrate(Sample(0.0, 150), Sample(1.0, 150), [], max_gap=10)
    assert device.busy == pytest.approx(1.0)


def test_a_job_over_two_devices_adds_device_seconds_not_wall_seconds():
    prev = {"0": Sample(0.0, 100, 1 * GiB), "1": Sample(0.0, 0, 2 * GiB)}
    cur = {"0": Sample(2.0, 100, 1 * GiB), "1": Sample(2.0, 0, 6 * GiB)}
    devices, jobs = integrate_host(prev, cur, {"0": [Holder(9)], "1": [Holder(9)]}, max_gap=10)
    assert devices["0"].busy == pytest.approx(2.0) and devices["1"].busy == 0
    assert (jobs[9].seconds, jobs[9].held, jobs[9].busy, jobs[9].peak_memory) == pytest.approx((2.0, 4.0, 2.0, 6 * GiB))


def test_the_report_line_and_the_mlflow_metrics():
    assert share_text(0.0, 0.0) == "no GPU held"
    assert share_text(7200.0, 5400.0) == "GPU busy 75% of the device time it held (2.00 device-hours)"
    assert metrics(10.0, 4.0, 3_500_000) == {UTILIZATION_METRIC: 40.0, MEMORY_USED_METRIC: 3.5}


# ---- the records and the sampler -----------------------------------------------------------------------------

def _holding(store: JobStore, device: str, *, share=None, host="h") -> int:
    job_id = store.submit(JobSpec(argv=["true"], track=False)).id
    if share is not None:  # as `submit --gpus 0.25` records it
        with store.db.tx() as session:
            session.connection().execute(update(Job.__table__).where(Job.__table__.c.id == job_id)
                                         .values(gpu_share=share))
    store.claim([(job_id, [device])], host)
    store.mark_running(job_id, 1, None, host)
    return job_id


class Clock:
    def __init__(self, monkeypatch, start: float):
        import orchestrator.service.gpuwatch as gw

        self.now = start
        monkeypatch.setattr(gw.time, "time", lambda: self.now)


def test_the_sampler_records_devices_and_holding_jobs_and_logs_them_once_they_end(home, monkeypatch):
    store = JobStore(f"sqlite:///{home / 'queue.db'}")
    store.hosts.sync_devices("h", ["0", "1", "cpu:0"])
    shared_a, shared_b = _holding(store, "0", share=0.25), _holding(store, "0", share=0.5)
    whole = _holding(store, "1")
    for job_id in (shared_a, shared_b, whole):  # they held the devices long before the sampler's first look
        with store.db.tx() as session:
            session.connection().execute(update(Job.__table__).where(Job.__table__.c.id == job_id)
                                         .values(started_at=0.0))
    fake = FakeNvml(["GPU-aaaa", "GPU-bbbb"], pids=[4242])
    nv = Nvml(fake, timeout_s=2).open()
    sent: list = []
    watch = GpuWatch(store, "h", interval=2.0, session=lambda: nv, log_runs=sent.extend)
    clock = Clock(monkeypatch, 1000.0)
    fake.util.update({0: 60, 1: 20})
    fake.used.update({0: 30 * GiB, 1: 10 * GiB})
    assert watch.sample_once() == 2  # the GPUs only: a cpu slot is never asked about
    clock.now = 1002.0
    fake.util.update({0: 100, 1: 20})
    fake.used[0] = 50 * GiB
    watch.sample_once()
    clock.now = 1004.0
    fake.used[0] = 40 * GiB
    watch.sample_once()

    records = GpuUse(store.db)
    rows = {r.device: r for r in records.devices("h")}
    assert set(rows) == {"0", "1"}
    d0 = rows["0"]
    assert (d0.util, d0.mem_used, d0.mem_total, d0.pids) == (100, 40 * GiB, 80 * GiB, [4242])  # the last sample
    # 60 -> 100 over 2 s (80% mean) then 100 -> 100 over 2 s: 1.6 + 2.0 busy seconds of 4 observed, all held.
    assert (d0.seconds, d0.busy_seconds, d0.held_seconds, d0.busy_held_seconds) == pytest.approx((4, 3.6, 4, 3.6))
    assert rows["1"].busy_seconds == pytest.approx(0.8)

    jobs = records.jobs([shared_a, shared_b, whole])
    assert (jobs[shared_a].seconds, jobs[shared_a].held_seconds, jobs[shared_a].busy_seconds) == \
        pytest.approx((4.0, 1.0, 0.9))
    assert jobs[shared_b].held_seconds == pytest.approx(2.0) and jobs[shared_a].peak_memory == 50 * GiB
    assert busy_share(store, [shared_a, shared_b]) == pytest.approx((3.0, 2.7))
    assert busy_share(store.db, [whole]) == pytest.approx((4.0, 0.8))
    assert busy_share(store, [9999]) == (0, 0)

    # Nothing is logged while the jobs run; once one ends, its figures go out once (no run: nothing to send).
    assert watch.log_ended() == 0
    store.finish(whole, 0, "h")
    with store.db.tx() as session:
        session.connection().execute(update(Job.__table__).where(Job.__table__.c.id == shared_a)
                                     .values(mlflow_run_id="run-a"))
    store.finish(shared_a, 0, "h")
    assert watch.log_ended() == 2 and watch.log_ended() == 0
    assert sent == [{"run": "run-a", "metrics": {UTILIZATION_METRIC: 90.0, MEMORY_USED_METRIC: round(50 * GiB / 1e6, 3)}}]


def test_the_sampler_leaves_cpu_slots_and_a_host_without_nvml_alone(home):
    store = JobStore(f"sqlite:///{home / 'queue.db'}")
    store.hosts.sync_devices("h", ["cpu:0", "cpu:1"])
    opened = []
    watch = GpuWatch(store, "h", interval=2.0, session=lambda: opened.append(1))
    assert watch.sample_once() == 0 and opened == []  # no NVML session is even opened
    store.hosts.sync_devices("h", ["0"])
    nv = Nvml(FakeNvml([]), timeout_s=1)  # never opened: not available, as on a host without a driver
    assert GpuWatch(store, "h", interval=2.0, session=lambda: nv).sample_once() == 0
    assert GpuUse(store.db).devices() == []


def test_the_ledger_charges_a_job_sharing_a_gpu_its_share_of_the_time(home):
    import time

    from orchestrator.agent.history import device_seconds
    from orchestrator.queue import usage as ledger

    store = JobStore(f"sqlite:///{home / 'queue.db'}")
    quarter, whole = _holding(store, "0", share=0.25), _holding(store, "1")
    time.sleep(0.05)
    store.finish(quarter, 0, "h")
    store.finish(whole, 0, "h")
    held = {a.job_id: a for a in ledger.attempts(store)}
    assert held[quarter].gpus == 0.25 and held[whole].gpus == 1
    assert held[quarter].device_seconds() == pytest.approx(0.25 * (held[quarter].end - held[quarter].start))
    assert device_seconds(store, store.get(quarter)) == pytest.approx(held[quarter].device_seconds())
