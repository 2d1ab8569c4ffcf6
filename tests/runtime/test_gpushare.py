"""Sharing a GPU, the job's side: the memory cap, out-of-memory as "run me alone", the peak memory report.

No GPU here: the decisions are pure functions, and CUDA is a stand-in object with torch.cuda's few calls (the
edge), handed to the same code paths a GPU job takes. Exit codes and files come from real job processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from runtime import gpushare, protocol
from runtime.context import ContextConfig, JobContext
from runtime.errors import RuntimeJobError

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30
NO_SIGNALS = ContextConfig(handle_signals=False)


class FakeCuda:
    """torch.cuda as far as the runtime uses it: lazy initialisation with queued calls, one device's memory."""

    def __init__(self, total: int = 80 * GIB, initialized: bool = False, lazy: bool = True) -> None:
        self.total, self.initialized = total, initialized
        self.queued: list = []
        self.fractions: list[tuple[float, int]] = []
        self.peak = 0
        if lazy:
            self._lazy_call = self._lazy

    def _lazy(self, fn) -> None:
        (fn() if self.initialized else self.queued.append(fn))

    def init(self) -> None:  # what the first CUDA tensor does
        self.initialized = True
        for fn in self.queued:
            fn()
        self.queued.clear()

    def is_initialized(self) -> bool:
        return self.initialized

    def get_device_properties(self, index: int):
        assert self.initialized, "reading device properties initialises CUDA"
        return type("Props", (), {"total_memory": self.total})()

    def set_per_process_memory_fraction(self, fraction: float, device: int) -> None:
        assert isinstance(fraction, float) and 0 <= fraction <= 1  # what torch enforces
        self.fractions.append((fraction, device))

    def max_memory_reserved(self, index: int) -> int:
        return self.peak


@pytest.fixture
def job_env(home, monkeypatch, tmp_path):
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MLFLOW_RUN_ID", protocol.GPU_SHARE, protocol.GPU_MEMORY):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv(protocol.JOB_ID, "5")
    monkeypatch.setenv(protocol.ATTEMPT, "3")
    monkeypatch.setenv(protocol.CHECKPOINT_DIR, str(tmp_path / "ck"))
    return tmp_path / "ck"


@pytest.mark.parametrize("share, memory, total, want", [
    (0.25, None, None, 0.25),          # only a share
    (None, 10 * GIB, 40 * GIB, 0.25),  # only memory: memory / total
    (0.5, 10 * GIB, 40 * GIB, 0.25),   # both: the smaller
    (0.25, 30 * GIB, 40 * GIB, 0.25),
    (None, 80 * GIB, 40 * GIB, 1.0),   # more than the device has: the whole device, never above 1
    (None, None, 40 * GIB, None),      # neither: no cap
])
def test_memory_fraction(share, memory, total, want):
    assert gpushare.memory_fraction(share, memory, total) == want


def test_memory_fraction_needs_the_total_for_a_memory_limit():
    with pytest.raises(ValueError):
        gpushare.memory_fraction(0.5, GIB, None)


def test_read_env_parses_and_refuses_bad_values():
    assert gpushare.read_env({}) == (None, None)
    assert gpushare.read_env({protocol.GPU_SHARE: "", protocol.GPU_MEMORY: ""}) == (None, None)
    assert gpushare.read_env({protocol.GPU_SHARE: "0.25", protocol.GPU_MEMORY: str(10 * GIB)}) == (0.25, 10 * GIB)
    for bad in ({protocol.GPU_SHARE: "0"}, {protocol.GPU_SHARE: "1.5"}, {protocol.GPU_SHARE: "nan"},
                {protocol.GPU_SHARE: "quarter"}, {protocol.GPU_MEMORY: "10GiB"}, {protocol.GPU_MEMORY: "-1"}):
        with pytest.raises(RuntimeJobError) as err:
            gpushare.read_env(bad)
        assert "\n" not in str(err.value) and next(iter(bad)) in str(err.value)


def test_the_cap_waits_for_cuda_to_initialise_and_lands_before_any_allocation():
    cuda = FakeCuda(total=40 * GIB)
    assert gpushare.apply_cap(cuda, 0, 0.5, 10 * GIB)
    assert cuda.fractions == [] and not cuda.initialized  # queued, CUDA left alone
    cuda.init()
    assert cuda.fractions == [(0.25, 0)]
    ready = FakeCuda(initialized=True)
    assert gpushare.apply_cap(ready, 1, 0.125, None)  # CUDA already up: at once, on the job's device
    assert ready.fractions == [(0.125, 1)]
    nothing = FakeCuda(initialized=True)
    assert gpushare.apply_cap(nothing, 0, None, None) and nothing.fractions == []


def test_without_lazy_call_the_cap_is_applied_once_cuda_is_up():
    cuda = FakeCuda(lazy=False)
    assert not gpushare.apply_cap(cuda, 0, 0.25, None)  # the caller tries again later
    cuda.initialized = True
    assert gpushare.apply_cap(cuda, 0, 0.25, None) and cuda.fractions == [(0.25, 0)]


def test_peak_memory_in_mlflow_megabytes_only_after_cuda_was_used():
    cuda = FakeCuda(total=80 * GIB)
    assert gpushare.peak_memory(cuda, 0) is None
    cuda.init()
    cuda.peak = 3_000_000_000
    assert gpushare.peak_memory(cuda, 0) == {protocol.PEAK_MEMORY_METRIC: 3000.0,
                                             protocol.DEVICE_MEMORY_METRIC: 80 * GIB / 1e6}


def test_is_oom():
    import torch

    assert gpushare.is_oom(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert gpushare.is_oom(RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    assert not gpushare.is_oom(RuntimeError("shape mismatch"))
    assert not gpushare.is_oom(MemoryError())  # host memory: not the neighbours' fault
    try:
        try:
            raise RuntimeError("CUDA out of memory.")
        except RuntimeError as exc:
            raise ValueError("step failed") from exc
    except ValueError as chained:
        assert gpushare.is_oom(chained)


def test_the_context_reads_the_share_and_memory(job_env, monkeypatch):
    ctx = JobContext.from_env(NO_SIGNALS)
    assert (ctx.gpu_share, ctx.gpu_memory, ctx.sharing) == (None, None, False)
    monkeypatch.setenv(protocol.GPU_SHARE, "0.25")
    monkeypatch.setenv(protocol.GPU_MEMORY, str(10 * GIB))
    ctx = JobContext.from_env(NO_SIGNALS)
    assert (ctx.gpu_share, ctx.gpu_memory, ctx.sharing) == (0.25, 10 * GIB, True)
    monkeypatch.setenv(protocol.GPU_SHARE, "1")
    assert not JobContext.from_env(NO_SIGNALS).sharing  # the whole device
    monkeypatch.setenv(protocol.GPU_SHARE, "2")
    with pytest.raises(RuntimeJobError):
        JobContext.from_env(NO_SIGNALS)


def _gpu_context(tmp_path, **kw) -> JobContext:
    return JobContext(job_id=5, attempt=1, params={}, checkpoint_dir=tmp_path / "ck", device="cuda:0",
                      config=NO_SIGNALS, **kw)


def test_a_gpu_job_is_capped_when_it_enters_and_reports_its_peak_when_it_closes(home, monkeypatch, tmp_path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    run_id = client.create_run(client.create_experiment("share")).info.run_id
    cuda = FakeCuda(total=80 * GIB)
    monkeypatch.setattr(gpushare, "loaded_cuda", lambda: cuda)  # the GPU edge: torch.cuda of a job with one
    with _gpu_context(tmp_path, gpu_share=0.25, run_id=run_id) as ctx:
        assert cuda.fractions == [] and cuda.queued  # registered, CUDA not initialised for it
        cuda.init()  # the job's first CUDA tensor
        assert cuda.fractions == [(0.25, 0)]
        cuda.peak = 12_500_000_000
        ctx.heartbeat(40, force=True)
    metrics = client.get_run(run_id).data.metrics
    assert metrics == {protocol.PEAK_MEMORY_METRIC: 12500.0, protocol.DEVICE_MEMORY_METRIC: 80 * GIB / 1e6}
    assert {m.step for m in client.get_metric_history(run_id, protocol.PEAK_MEMORY_METRIC)} == {40}


def test_torch_imported_after_entering_is_capped_at_the_next_step(home, monkeypatch, tmp_path):
    seen = {"cuda": None}
    monkeypatch.setattr(gpushare, "loaded_cuda", lambda: seen["cuda"])
    with _gpu_context(tmp_path, gpu_memory=20 * GIB) as ctx:
        seen["cuda"] = cuda = FakeCuda(total=80 * GIB)  # `import torch` inside the block
        assert not ctx.should_stop()
        cuda.init()
        assert cuda.fractions == [(0.25, 0)]
        ctx.heartbeat(1)
        assert len(cuda.fractions) == 1  # registered once


def test_a_process_that_never_used_cuda_reports_nothing(home, monkeypatch, tmp_path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    run_id = client.create_run(client.create_experiment("idle")).info.run_id
    monkeypatch.setattr(gpushare, "loaded_cuda", lambda: FakeCuda())
    with _gpu_context(tmp_path, gpu_share=0.5, run_id=run_id):
        pass
    assert client.get_run(run_id).data.metrics == {}


JOB = textwrap.dedent("""
    import sys
    from runtime.context import JobContext
    with JobContext.from_env() as ctx:
        ctx.heartbeat(7)
        print("torch imported:", "torch" in sys.modules, flush=True)
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79 GiB\\n"
                           "more detail")
""")


def _run_job(tmp_path, env: dict[str, str]) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = dict(os.environ, PYTHONPATH=str(ROOT), **env)
    return subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)


def test_out_of_memory_on_a_shared_gpu_asks_to_run_alone(job_env, tmp_path):
    out = _run_job(tmp_path, {protocol.GPU_SHARE: "0.25"})
    assert out.returncode == protocol.EX_TEMPFAIL, out.stderr
    assert out.stdout.strip() == "torch imported: False"  # a job that never uses torch does not pay for it
    assert out.stderr.strip() == "autoresearch: out of GPU memory on a shared GPU (share 0.25); asking to run alone"
    record = json.loads((job_env / protocol.OOM_FILE).read_text())
    assert record["attempt"] == 3 and record["at"] > 0
    assert record["error"] == "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79 GiB"
    assert protocol.oom_attempt(job_env) == 3
    assert sorted(p.name for p in job_env.iterdir()) == sorted([protocol.OOM_FILE, "heartbeat.json"])  # no tmp left


def test_out_of_memory_without_a_share_fails_as_usual(job_env, tmp_path):
    out = _run_job(tmp_path, {})
    assert out.returncode == 1 and "Traceback" in out.stderr and "CUDA out of memory" in out.stderr
    assert protocol.oom_attempt(job_env) is None


def test_torch_cuda_has_what_the_runtime_calls():
    # The stand-in above mirrors these; a torch that renames one must fail here, not silently uncap a job.
    import torch

    for name in ("_lazy_call", "is_initialized", "get_device_properties", "set_per_process_memory_fraction",
                 "max_memory_reserved"):
        assert callable(getattr(torch.cuda, name)), name
