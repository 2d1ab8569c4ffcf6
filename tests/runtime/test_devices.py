"""Device names and identity against a fake NVML (the edge that cannot exist here): `auto` within the
service's CUDA_VISIBLE_DEVICES, UUIDs kept as given, loud mismatches; the NVML session's fallbacks and timeouts."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from runtime import preflight as pf
from runtime.devices import DeviceSpecError, job_device, normalize_uuid, parse_devices
from runtime.nvml import Nvml
from tests.orchestrator.helpers import wait_for
from tests.support.fake_nvml import FakeNvml

A, B = "GPU-aaaa1111-0000-0000-0000-000000000000", "GPU-bbbb2222-0000-0000-0000-000000000000"
MIG = "MIG-cccc3333-0000-0000-0000-000000000000"


def auto(cvd=None, **kw):
    env = {} if cvd is None else {"CUDA_VISIBLE_DEVICES": cvd}
    return parse_devices("auto", env=env, nvml=Nvml(FakeNvml([A, B], **kw)))


def test_auto_is_every_gpu_without_an_inherited_mask():
    assert auto() == ["0", "1"]


def test_auto_keeps_the_inherited_identifiers_as_given():
    assert auto("1") == ["1"]
    assert auto(f"{B},{A}") == [B, A]  # UUIDs stay UUIDs (and in the order given)
    assert auto("GPU-bbbb") == ["GPU-bbbb"]  # a unique prefix, as CUDA accepts
    assert auto(MIG, migs={0: [MIG]}) == [MIG]


@pytest.mark.parametrize("cvd, what", [("GPU-ffff", "'GPU-ffff' matches 0"), ("5", "'5' matches 0"),
                                       ("GPU-", "matches 2"), ("", "is empty")])
def test_auto_fails_loudly_on_a_mask_nvml_cannot_match(cvd, what):
    with pytest.raises(DeviceSpecError, match=what) as err:
        auto(cvd)
    assert "\n" not in str(err.value)


def test_explicit_lists_accept_uuids():
    assert parse_devices(f"{A},1") == [A, "1"]
    with pytest.raises(DeviceSpecError):
        parse_devices("GPU-x,GPU-x")


def test_uuids_compare_across_nvml_and_torch_spellings():
    assert normalize_uuid(A) == normalize_uuid(A[4:].upper())
    assert normalize_uuid(MIG) == MIG[4:]


def test_a_rank_without_its_own_gpu_is_an_error_not_another_rank_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert job_device(0) == "cpu"  # a cpu slot
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # GPUs assigned, none visible to CUDA here
    with pytest.raises(DeviceSpecError, match="rank 1 has no GPU"):
        job_device(1)


@pytest.mark.parametrize("mode, calls", [("new", ["events"]), ("old", ["throttle"]),
                                         ("missing-symbol", ["events-missing", "throttle"])])
def test_throttle_falls_back_to_the_older_call(mode, calls):
    fake = FakeNvml([A], clock_events=mode, masks=[0x40])
    with Nvml(fake) as nv:
        status, value, _, message = nv.throttle("0")
    assert (status, value, message) == ("fail", "0x40", "hw_thermal_slowdown")
    assert fake.calls == calls


def test_nvml_names_resolve_by_index_and_uuid():
    with Nvml(FakeNvml([A, B])) as nv:
        assert nv.uuid("1") == B and nv.uuid("GPU-aaaa") == A
        assert nv.foreign_processes(B)[0] == "pass"


def test_a_hung_nvml_call_times_out_and_does_not_queue_more():
    gate = threading.Event()
    nv = Nvml(FakeNvml([A], hang=gate), timeout_s=0.2).open()
    try:
        t0 = time.monotonic()
        status, _, _, message = nv.ecc("0")
        assert status == "fail" and "took over 0.2s" in message
        status, _, _, message = nv.ecc("0")  # still hung: fails at once
        assert "still hung" in message and time.monotonic() - t0 < 1.5
        gate.set()
        wait_for(lambda: nv.ecc("0")[0] == "pass", timeout=10, what="calls to pass once the hung one returned")
    finally:
        gate.set()
        nv.close()


def test_monitor_sample_uses_a_given_long_lived_session():
    fake = FakeNvml([A, B])
    nv = Nvml(fake).open()
    for _ in range(3):
        sample = pf.monitor_sample(["0", B], nvml=nv)
        assert {(r.device, r.status) for r in sample} == {("0", "pass"), (B, "pass")}
    nv.close()
    assert (fake.inits, fake.shutdowns) == (1, 1)


def test_auto_leaves_an_open_session_open():
    fake = FakeNvml([A, B])
    nv = Nvml(fake).open()
    assert parse_devices("auto", env={}, nvml=nv) == ["0", "1"]
    assert nv.available and nv.uuid("1") == B and fake.shutdowns == 0
    nv.close()


def test_an_mps_server_on_the_gpu_is_not_a_foreign_process(tmp_path):
    """Under `serve --mps` NVML lists the device's MPS server as a compute process: the quick checks before the
    next job must not take it for another job's memory (and quarantine the device), while any other process
    still is foreign."""
    import shutil
    import subprocess

    server_exe = tmp_path / "nvidia-cuda-mps-server"
    shutil.copy(shutil.which("sleep"), server_exe)
    server = subprocess.Popen([str(server_exe), "30"])
    other = subprocess.Popen(["sleep", "30"])
    try:
        # Popen can return before the kernel has renamed the child (the exec's close-on-exec comes first): wait
        # for the name NVML's caller reads, as a real server has it from its start.
        wait_for(lambda: Path(f"/proc/{server.pid}/comm").read_text().strip() == server_exe.name[:15],
                 what="the stand-in server's process name")
        with Nvml(FakeNvml([A], pids=[server.pid])) as nv:
            assert nv.foreign_processes("0")[0] == "pass"
        with Nvml(FakeNvml([A], pids=[server.pid, other.pid])) as nv:
            status, count, _, message = nv.foreign_processes("0")
        assert (status, count, message) == ("fail", 1, f"foreign processes: [{other.pid}]")
    finally:
        for proc in (server, other):
            proc.kill()
            proc.wait()
