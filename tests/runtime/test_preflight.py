"""Preflight on a host without GPUs: skipped-not-pass, fault injection per device, gloo all-reduce, CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import faults
from runtime import preflight as pf
from runtime.preflight import CheckResult, PreflightConfig

ROOT = Path(__file__).resolve().parents[2]
with pf.Nvml() as _nv:
    HAS_GPU = _nv.count() > 0


def by(results, device, check):
    (hit,) = [r for r in results if r.device == device and r.check == check]
    return hit


def test_gpu_checks_on_cpu_slots_are_skipped_never_pass(monkeypatch):
    monkeypatch.delenv("AUTORESEARCH_FAULTS", raising=False)
    results = pf.run(["cpu:0", "cpu:1"], "quick")
    for r in results:
        if r.check in pf.GPU_ONLY:
            assert r.status == "skipped", r
    assert by(results, "cpu:0", "matmul").status == "pass"
    assert by(results, "cpu:1", "alloc").status == "pass"
    assert pf.healthy(results) and pf.reason(results) == ""
    assert {r.check for r in results} == set(pf.QUICK)


# The service checks its cpu slots again every `preflight_ttl` seconds, from its dispatcher thread.
REPEATED_CHECKS = """
import json, sys, threading
import psutil
from runtime import preflight
cfg = preflight.PreflightConfig(alloc_mb=16, matmul_n=128)
me, grown, status = psutil.Process(), [], []
def checks():
    before = me.memory_info().rss
    for _ in range(5):
        status.extend(r.status for r in preflight.run(["cpu:0"], "quick", config=cfg) if r.check == "alloc")
    grown.append((me.memory_info().rss - before) / 2**20)
for where in ("main", "thread"):
    if where == "main":
        checks()
    else:
        worker = threading.Thread(target=checks)
        worker.start()
        worker.join()
print(json.dumps({"grown": grown, "status": status}))
"""


def test_repeated_cpu_slot_checks_leave_no_memory_behind():
    """A cpu slot's 16 MiB check, five times in a fresh process (in its main thread, then in another): the
    process keeps no more than a few MiB of it. A freed heap block of that size stayed resident, and the
    service grew by 17 MB at its first re-check."""
    out = subprocess.run([sys.executable, "-c", REPEATED_CHECKS], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(grown < 6 for grown in seen["grown"]), seen
    assert seen["status"] == ["pass"] * 10, seen


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU host path")
def test_missing_gpu_fails_visible_and_skips_the_rest():
    results = pf.run(["0"], "quick")
    assert by(results, "0", "visible").status == "fail"
    assert all(r.status == "skipped" for r in results if r.check != "visible")
    assert not pf.healthy(results)


def test_fault_fails_named_check_on_named_device_only(monkeypatch):
    monkeypatch.setenv("AUTORESEARCH_FAULTS", "cpu:1:ecc, cpu:0:matmul")
    results = pf.run(["cpu:0", "cpu:1", "cpu:2"], "quick")
    failed = {(r.device, r.check) for r in results if r.status == "fail"}
    assert failed == {("cpu:1", "ecc"), ("cpu:0", "matmul")}
    assert by(results, "cpu:1", "ecc").message == faults.INJECTED
    assert "cpu:1:ecc" in pf.reason(results) and "cpu:2" not in pf.reason(results)
    assert pf.healthy([r for r in results if r.device == "cpu:2"])
    sample = pf.monitor_sample(["cpu:0", "cpu:1"])
    assert [(r.device, r.check) for r in sample if r.status == "fail"] == [("cpu:1", "ecc")]
    assert all(r.status == "skipped" for r in sample if r.device == "cpu:0")


def test_full_level_runs_a_real_gloo_allreduce(monkeypatch):
    monkeypatch.setenv("AUTORESEARCH_FAULTS", "cpu:2:allreduce")
    results = pf.run(["cpu:0", "cpu:1", "cpu:2"], "full")
    ar = [r for r in results if r.check == "allreduce"]
    assert [r.device for r in ar] == ["cpu:0", "cpu:1", "cpu:2"]
    assert [r.status for r in ar] == ["pass", "pass", "fail"]
    assert "gloo: sum ok" in ar[0].message and ar[0].value > 0
    assert by(results, "cpu:0", "matmul_tflops").status == "skipped"


def test_single_device_allreduce_is_skipped():
    from runtime.allreduce import allreduce_check

    assert [r.status for r in allreduce_check(["cpu:0"])] == ["skipped"]


def test_disk_and_volume_checks(tmp_path, monkeypatch):
    monkeypatch.delenv("AUTORESEARCH_FAULTS", raising=False)
    results = pf.run([], "quick", paths=[tmp_path / "ck"])
    assert [(r.check, r.status) for r in results] == [("disk", "pass"), ("volume", "pass")]
    assert list((tmp_path / "ck").iterdir()) == []  # the probe file is gone
    starved = pf.run([], "quick", paths=[tmp_path], config=PreflightConfig(min_free_gb=1e9))
    assert by(starved, "host", "disk").status == "fail"


def test_parse_devices():
    assert pf.parse_devices("cpu:3") == ["cpu:0", "cpu:1", "cpu:2"]
    assert pf.parse_devices("0,1,3") == ["0", "1", "3"]
    for bad in ("", "cpu:0", "gpu", "0,0", "1,,2"):
        with pytest.raises(ValueError):
            pf.parse_devices(bad)
    if not HAS_GPU:
        with pytest.raises(pf.DeviceSpecError, match="cpu:N"):
            pf.parse_devices("auto")


def test_results_and_config_validate():
    assert CheckResult("ecc", "0", "pass", 0, 0, "ok").to_dict()["status"] == "pass"
    with pytest.raises(ValueError):
        CheckResult("ecc", "0", "ok")
    with pytest.raises(ValueError):
        PreflightConfig(expect_fraction=0)
    with pytest.raises(ValueError):
        faults.parse("nocolon")
    assert faults.parse("cpu:1:ecc,*:matmul") == (faults.Fault("cpu:1", "ecc"), faults.Fault("*", "matmul"))


def test_checks_on_a_shared_gpu_stay_inside_the_share():
    gib = 1 << 30
    assert pf.shared_budget(80 * gib, {}) is None  # a GPU of its own: the usual sizes
    assert pf.shared_budget(80 * gib, {"AUTORESEARCH_GPU_SHARE": "0.25"}) == 20 * gib
    assert pf.shared_budget(80 * gib, {"AUTORESEARCH_GPU_SHARE": "0.5", "AUTORESEARCH_GPU_MEMORY": str(gib)}) == gib
    roomy = pf.within_budget(PreflightConfig(), 20 * gib)
    assert (roomy.alloc_mb, roomy.copy_mb) == (256, 1024)
    tight = pf.within_budget(PreflightConfig(), 200 << 20)  # a 200 MiB job: half of it for the test tensors
    assert (tight.alloc_mb, tight.copy_mb) == (100, 50)
    with pytest.raises(ValueError):
        PreflightConfig(copy_mb=0)


def _cli(args, home, faults_spec=""):
    env = dict(os.environ, AUTORESEARCH_HOME=str(home), AUTORESEARCH_FAULTS=faults_spec, PYTHONPATH=str(ROOT))
    env.pop("AUTORESEARCH_DEVICES", None)
    return subprocess.Popen([sys.executable, "-c", "import sys; from orchestrator.faces.cli import main; main(sys.argv[1:])",
                             "preflight", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_cli_exit_codes(home):
    # All at once: each is a fresh interpreter importing torch, the slow part on a small machine.
    procs = {"ok": _cli(["--devices", "cpu:2", "--json"], home),
             "fault": _cli(["--devices", "cpu:2"], home, faults_spec="cpu:1:ecc"),
             "bad": _cli(["--devices", "nonsense"], home)}
    if not HAS_GPU:
        procs["auto"] = _cli([], home)
    out = {k: (p.wait(timeout=120), *p.communicate()) for k, p in procs.items()}
    code, stdout, stderr = out["ok"]
    assert code == 0, stderr
    data = json.loads(stdout)
    assert data["healthy"] and {r["device"] for r in data["results"]} == {"cpu:0", "cpu:1", "host"}
    assert out["fault"][0] == 1 and "injected fault" in out["fault"][1]
    assert out["bad"][0] == 2 and "bad --devices" in out["bad"][2]
    if "auto" in out:
        assert out["auto"][0] == 2 and "cpu:N" in out["auto"][2]


def test_run_isolated_in_a_child_process(tmp_path):
    env = dict(os.environ, AUTORESEARCH_FAULTS="cpu:0:alloc")
    results = pf.run_isolated(["cpu:0", "cpu:1"], "quick", paths=[tmp_path], env=env)
    assert [(r.device, r.check) for r in results if r.status == "fail"] == [("cpu:0", "alloc")]
    assert {r.device for r in results} == {"cpu:0", "cpu:1", "host"}
    dead = pf.run_isolated(["cpu:0"], "quick", timeout_s=0.01)
    assert [(r.check, r.status) for r in dead] == [("preflight", "fail")]


NOISE = """
import sys
# What NCCL_DEBUG=INFO and friends print on the shared stdout of a preflight child and its workers.
print("host:1234:1234 [0] NCCL INFO Bootstrap : Using lo:127.0.0.1<0>")
print('[{"check": "visible", "device": "cpu:0", "status": "fail"}]')
print("NCCL INFO cudaDriverVersion 12040", flush=True)
"""


def test_run_isolated_ignores_noise_on_the_child_stdout(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NOISE)  # runs first in the child, as a chatty library would
    env = dict(os.environ, PYTHONPATH=str(site), NCCL_DEBUG="INFO")
    env.pop("AUTORESEARCH_FAULTS", None)
    probe = subprocess.run([sys.executable, "-c", "pass"], env=env, capture_output=True, text=True)
    assert "NCCL INFO" in probe.stdout  # the noise really reaches a child's stdout
    results = pf.run_isolated(["cpu:0", "cpu:1"], "quick", env=env)
    assert pf.healthy(results), pf.reason(results)
    assert {r.device for r in results} == {"cpu:0", "cpu:1"}
