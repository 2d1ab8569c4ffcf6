"""Packing an agent session's trials onto a GPU: one trial per GPU against packed trials, side by side.

The same agent session (charlm, random search with a fixed seed, fixed trial count) runs with packing off
(`--trials-per-gpu 1`), on (`auto`: measured from the baseline runs), and on under NVIDIA MPS (`serve --mps`
semantics through `AUTORESEARCH_MPS=1`). For each it reports the session's wall time, trials per GPU-hour
(trials that ran to their end, per hour of the devices the session had), the GPU's mean busy share sampled by
NVML every 0.5 s (none on cpu slots), the packing decision, and the verdict; ratios are against "off". Then a
fixed trial (the defaults, seed 0) runs alone and then K at once on one device, and their final metric is
compared: a trial's result must not depend on what shares its device.

    python benchmarks/gpu_packing.py                         # CUDA: --devices auto, charlm scale 8
    python benchmarks/gpu_packing.py --devices cpu:1 --scale 1 --pack 2 --trials 4   # CPU: the same code, quick

On cpu slots `auto` packs nothing (no GPU to measure), so `--pack N` is used there for the packed modes. With
$OUT set the figures are also written to $OUT/gpu_packing.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class Sampler:
    """NVML utilisation of every GPU every `interval` s on a thread (nothing where NVML is missing)."""

    def __init__(self, interval: float = 0.5):
        self.interval, self.samples, self._stop = interval, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:  # noqa: BLE001 - no driver: cpu slots
            self._nvml, self._handles = None, []

    def __enter__(self) -> "Sampler":
        if self._handles:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            util = [self._nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self._handles]
            used = [self._nvml.nvmlDeviceGetMemoryInfo(h).used for h in self._handles]
            self.samples.append((time.time(), util, used))

    def busy(self) -> float | None:
        """Mean utilisation over the samples and devices, 0..1 (None without samples)."""
        if not self.samples:
            return None
        return statistics.fmean(statistics.fmean(u) for _, u, _ in self.samples) / 100.0

    def peak_memory_gb(self) -> float | None:
        return max((max(m) for _, _, m in self.samples), default=0) / 1e9 if self.samples else None


def _env(home: Path, mps: bool) -> dict[str, str]:
    home.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, AUTORESEARCH_HOME=str(home), MLFLOW_TRACKING_URI=f"sqlite:///{home / 'mlflow.db'}",
               PYTHONUNBUFFERED="1", AUTORESEARCH_MPS="1" if mps else "0")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


# The model's size and the tokens per step are held fixed, so every trial costs about the same: the search is
# over optimisation and architecture choices that do not change the work (lr, schedule, betas, norm, ...).
FIXED = {"layers": 2, "heads": 4, "width": 128, "mlp_ratio": 4, "block_size": 64, "batch_size": 16}


def fixed(a) -> list[str]:
    """`--param` flags of the fixed settings, the scale and the step budget."""
    values = {**FIXED, "scale": a.scale, "max_steps": a.steps}
    return [arg for k, v in values.items() for arg in ("--param", f"{k}={v}")]


def session(name: str, a, work: Path) -> dict:
    """One agent session in a fresh home; its summary and the measurements around it."""
    mode = {"off": "1", "auto": "auto", "mps": "auto"}[name]
    if a.devices.startswith("cpu:") and mode == "auto":
        mode = str(a.pack)  # no GPU to measure: pack as told
    home = work / name
    cmd = [sys.executable, "-m", "orchestrator.faces.cli", "start", "--goal", "lower val_loss",
           "--experiment", "charlm", *fixed(a),
           "--proposer", "random", "--trials", str(a.trials), "--baseline-seeds", "2", "--confirm-top", "1",
           "--confirm-seeds", "2", "--no-early-stop", "--devices", a.devices, "--trials-per-gpu", mode, "--json"]
    t0 = time.time()
    with Sampler() as sampler, open(work / f"{name}.log", "w") as log:
        try:
            proc = subprocess.run(cmd, env=_env(home, name == "mps"), stdout=subprocess.PIPE, stderr=log, text=True,
                                  timeout=a.session_timeout)
        except subprocess.TimeoutExpired:
            return {"mode": name, "error": f"no end within {a.session_timeout:g} s (log: {work / name}.log)"}
    wall = time.time() - t0
    proc.stderr = (work / f"{name}.log").read_text()
    if proc.returncode != 0:
        return {"mode": name, "error": proc.stderr.strip().splitlines()[-3:], "wall_s": round(wall, 1)}
    summary = json.loads(proc.stdout)
    ended = (summary.get("counts") or {}).get("succeeded", 0)
    devices = 1 if not a.devices.startswith("cpu:") else int(a.devices.split(":")[1])
    packing = summary.get("packing") or {}
    return {"mode": name, "wall_s": round(wall, 1), "trials": ended,
            "trials_per_device_hour": round(ended / (wall / 3600.0) / devices, 1),
            "busy": sampler.busy(), "peak_memory_gb": sampler.peak_memory_gb(),
            "k": packing.get("trials_per_gpu"), "packing": packing.get("decisions"),
            "verdict": summary.get("verdict"), "headline": summary.get("headline"),
            "best": summary.get("best"), "gpu_line": (summary.get("gpu") or {}).get("text")}


def same_trial(a, work: Path) -> dict:
    """The defaults on seed 0, alone and then `a.pack` at once on one device: their final val_loss."""
    home = work / "same"
    env = _env(home, False)
    serve = subprocess.Popen([sys.executable, "-m", "orchestrator.faces.cli", "serve", "--devices",
                              a.devices.split(",")[0] if not a.devices.startswith("cpu:") else "cpu:1",
                              "--preempt-after", "0"], env=env, stdout=subprocess.DEVNULL,
                             stderr=open(work / "same-serve.log", "w"))
    share = f"{1 / a.pack:.4g}"
    try:
        def submit(gpus: str) -> int:
            out = subprocess.run([sys.executable, "-m", "orchestrator.faces.cli", "submit", "--experiment", "charlm",
                                  *fixed(a), "--param", "seed=0", "--gpus", gpus, "--json"], env=env,
                                 capture_output=True, text=True, check=True)
            return json.loads(out.stdout)["id"]

        def wait(ids: list[int]) -> list[dict]:
            deadline = time.time() + a.session_timeout
            while time.time() < deadline:
                out = subprocess.run([sys.executable, "-m", "orchestrator.faces.cli", "queue", "--all", "--json"],
                                     env=env, capture_output=True, text=True, check=True)
                jobs = {j["id"]: j for j in json.loads(out.stdout)}
                if all(jobs[i]["state"] in ("SUCCEEDED", "FAILED", "CANCELLED") for i in ids):
                    return [jobs[i] for i in ids]
                time.sleep(1)
            raise TimeoutError("the same-trial jobs did not end")

        t0 = time.time()
        alone = wait([submit("1")])
        t_alone = time.time() - t0
        t0 = time.time()
        packed = wait([submit(share) for _ in range(a.pack)])
        t_packed = time.time() - t0
    finally:
        serve.terminate()
        serve.wait(timeout=60)
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    loss = [client.get_run(j["mlflow_run_id"]).data.metrics.get("val_loss") for j in alone + packed]
    return {"k": a.pack, "states": [j["state"] for j in alone + packed], "val_loss": loss,
            "alone_s": round(t_alone, 1), "packed_s": round(t_packed, 1),
            "max_abs_diff": max(abs(v - loss[0]) for v in loss) if None not in loss else None,
            "bitwise": len(set(loss)) == 1}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", default="auto")
    ap.add_argument("--scale", type=int, default=8)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--trials", type=int, default=6, help="search trials plus re-runs, per session")
    ap.add_argument("--pack", type=int, default=4, help="trials at once in the same-trial check (and on cpu slots)")
    ap.add_argument("--modes", default="off,auto,mps")
    ap.add_argument("--session-timeout", type=float, default=400)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpu-packing-"))
    out = {"devices": a.devices, "scale": a.scale, "steps": a.steps, "trials": a.trials, "sessions": []}
    try:
        out["same_trial"] = same_trial(a, work)
    except Exception as exc:  # noqa: BLE001 - reported, the sessions still run
        out["same_trial"] = {"error": str(exc)}
    print("same trial:", json.dumps(out["same_trial"]), flush=True)
    save(out)
    for name in a.modes.split(","):
        result = session(name, a, work)
        out["sessions"].append(result)
        print(json.dumps(result), flush=True)
        save(out)
    base = next((s for s in out["sessions"] if s["mode"] == "off" and "error" not in s), None)
    print(f"\n{'mode':6} {'k':>3} {'wall s':>7} {'trials':>6} {'/dev-h':>7} {'ratio':>6} {'busy':>5}  verdict")
    for s in out["sessions"]:
        if "error" in s:
            print(f"{s['mode']:6} error: {s['error']}")
            continue
        ratio = s["trials_per_device_hour"] / base["trials_per_device_hour"] if base else float("nan")
        busy = f"{s['busy']:.0%}" if s["busy"] is not None else "-"
        print(f"{s['mode']:6} {str(s['k'] or '-'):>3} {s['wall_s']:7.1f} {s['trials']:6d} "
              f"{s['trials_per_device_hour']:7.1f} {ratio:6.2f} {busy:>5}  {s['headline'] or s['verdict']}")
    return 0


def save(out: dict) -> None:
    """The figures so far into $OUT/gpu_packing.json (a run cut short still leaves what it measured)."""
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_packing.json").write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
