"""Program mode on K slots against the sequential keep/reset loop (karpathy/autoresearch's), same program and answers.

    python benchmarks/program_parallel.py [--slots 4] [--run-seconds 5] [--think 0.5] [--runs 24] [--seq-runs 8]
                                          [--holdout-seconds S]

The program sleeps for its fixed budget and prints `score: <number>` (a GPU-bound run: the host CPU is idle while
it runs, which is what lets K virtual `cpu:N` slots stand in for K GPUs on a 2-core box). The LLM is the local
OpenAI-compatible fake, answering from one script of edits and taking `--think` seconds per answer.

- sequential: ask, apply the edit, commit, run `python train.py`, keep the commit if the score improved, else
  `git reset --hard HEAD~1`; one device.
- program mode: `autoresearch start --program` with K slots, the real queue service, MLflow, worktrees, re-runs
  and the noise gate.

Printed: experiments (runs of the fixed budget) per device-hour and per hour for both, the ratio of program
mode's rate to K x the sequential rate (aim >= 0.9), and the share of device time left idle in program mode
between the first start and the last end (aim < 5%), which is where the agent's thinking would show.

`--holdout-seconds S`: the program mode's program also has a holdout (an ignored `holdout.txt` and a protected
`evaluate.py` that takes S seconds to score the commit on it, as `holdout_eval`); printed is the device time of
its evaluation jobs (the baseline's and the kept commit's, at the session's end) as a share of the session's
device time (aim < 5%).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TRAIN = """import os, random, time
from prepare import evaluate
LR = 1.0
random.seed(int(os.environ.get("AUTORESEARCH_SEED", "0")))
time.sleep({run})
print(f"score: {{evaluate(LR) + random.gauss(0, 0.01):.6f}}", flush=True)
"""
PREPARE = "def evaluate(lr):\n    return (lr - 3.0) ** 2\n"
EVALUATE = """import pathlib, re, time
time.sleep({seconds})
lr = float(re.search(r"^LR = (.*)$", pathlib.Path("train.py").read_text(), re.M).group(1))
shift = float(pathlib.Path("holdout.txt").read_text())
print(f"score: {{(lr - 3.0 - shift) ** 2:.6f}}", flush=True)
"""


def add_holdout(root: Path, seconds: float) -> Path:
    """Give the program a holdout: `holdout.txt` (ignored, never committed) and the protected `evaluate.py`."""
    (root / ".gitignore").write_text("holdout.txt\n")
    (root / "evaluate.py").write_text(EVALUATE.format(seconds=seconds))
    (root / "holdout.txt").write_text("0.25\n")
    toml = (root / "autoresearch.toml").read_text().replace('protected = ["prepare.py"]',
                                                            'protected = ["prepare.py", "evaluate.py"]')
    (root / "autoresearch.toml").write_text(toml + f'holdout = ["holdout.txt"]\nholdout_eval = "{sys.executable} '
                                            f'evaluate.py"\n')
    for args in (["add", "-A"], ["commit", "-qm", "holdout evaluator"]):
        subprocess.run(["git", "-c", "user.name=b", "-c", "user.email=b@b", *args], cwd=root, check=True)
    return root


def make_program(root: Path, run: float, repeats: int) -> Path:
    root.mkdir(parents=True)
    (root / "train.py").write_text(TRAIN.format(run=run))
    (root / "prepare.py").write_text(PREPARE)
    (root / "autoresearch.toml").write_text(
        f'[program]\nedit = ["train.py"]\nprotected = ["prepare.py"]\nrun = "{sys.executable} train.py"\n'
        f'metric = "score"\ndirection = "minimize"\ntime_limit = "{int(run * 4) + 30}s"\nrepeats = {repeats}\n'
        f'patience = 1000\nmax_failures = 1000\n')
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-qm", "program"]):
        subprocess.run(["git", "-c", "user.name=b", "-c", "user.email=b@b", *args], cwd=root, check=True)
    return root


class Script:
    """The scripted answers: an endless walk of learning rates, each proposal one edit of `LR = 1.0`-like text."""

    def __init__(self, think: float):
        self.think = think
        self.i = 0

    def lrs(self, n: int) -> list[float]:
        out = []
        for _ in range(n):
            self.i += 1
            out.append(round(1.0 + 0.037 * self.i, 4))
        return out

    def answer(self, body: dict):
        from tests.agent.fake_llm import Step

        prompt = body["messages"][-1]["content"]
        m = re.search(r"Propose (\d+)", prompt)
        n = int(m.group(1)) if m else 1
        current = re.search(r"LR = ([0-9.]+)", prompt)
        search = f"LR = {current.group(1)}" if current else "LR = 1.0"
        props = [{"parent": "best", "rationale": f"lr {lr}", "edits": [
            {"file": "train.py", "search": search, "replace": f"LR = {lr}"}]} for lr in self.lrs(n)]
        return Step(200, json.dumps({"proposals": props}), self.think)


def sequential(program: Path, fake_url: str, runs: int) -> dict:
    """karpathy/autoresearch's loop: one run at a time in one checkout, keep or reset."""
    import openai

    from orchestrator.programs import edits, spec as specs

    spec = specs.load(program)
    client = openai.OpenAI(base_url=fake_url, api_key="unused", max_retries=0)
    best = None
    run_time = 0.0
    start = time.time()
    for _ in range(runs):
        text = (program / "train.py").read_text()
        reply = client.chat.completions.create(model="fake", messages=[
            {"role": "user", "content": f"Propose 1 improvement.\n{text}"}], response_format={"type": "json_object"})
        proposal = json.loads(reply.choices[0].message.content)["proposals"][0]
        files = edits.apply(spec, lambda f: (program / f).read_text(), proposal["edits"])
        (program / "train.py").write_text(files["train.py"])
        subprocess.run(["git", "-c", "user.name=b", "-c", "user.email=b@b", "commit", "-qam", "try"], cwd=program,
                       check=True)
        t0 = time.time()
        out = subprocess.run([sys.executable, "train.py"], cwd=program, capture_output=True, text=True)
        run_time += time.time() - t0
        value = float(re.search(r"^score:\s*(\S+)", out.stdout, re.M).group(1))
        if best is None or value < best:
            best = value
        else:
            subprocess.run(["git", "reset", "-q", "--hard", "HEAD~1"], cwd=program, check=True)
    wall = time.time() - start
    return {"runs": runs, "wall_s": wall, "per_hour": runs / wall * 3600, "per_device_hour": runs / wall * 3600,
            "idle_share": 1 - run_time / wall, "best": best}


def parallel(program: Path, fake_url: str, runs: int, slots: int, home: Path) -> dict:
    os.environ["AUTORESEARCH_HOME"] = str(home)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{home / 'mlflow.db'}"
    os.environ["OPENAI_BASE_URL"] = fake_url
    from orchestrator.core.config import Settings
    from orchestrator.programs.session import ProgramConfig, start
    from orchestrator.queue.store import JobStore

    t0 = time.time()
    summary = start(ProgramConfig(goal="lower score", program=str(program), trials=runs, parallel=slots, poll=0.2,
                                  llm={"timeout": 30.0}), devices=f"cpu:{slots}")
    wall = time.time() - t0
    every = JobStore(Settings.load().db_url).list(owner=summary["session"])
    evals = [j for j in every if (j.params or {}).get("holdout")]
    jobs = [j for j in every if not (j.params or {}).get("holdout")]
    spent = lambda js: sum(j.finished_at - j.started_at for j in js if j.started_at and j.finished_at)  # noqa: E731
    busy = spent(jobs)
    first = min(j.started_at for j in jobs if j.started_at)
    last = max(j.finished_at for j in jobs if j.finished_at)
    window = last - first
    n = len(jobs)
    # Idle while the agent works: from the first start to the last start, each device's time between the end
    # of one run and the start of its next (or before its first). After the last start the session is only
    # draining its final runs: that tail is the budget ending, not the agent thinking.
    steady_end = max(j.started_at for j in jobs if j.started_at)
    gaps, last_end = 0.0, {}
    for j in sorted((j for j in jobs if j.started_at), key=lambda j: j.started_at):
        for d in j.devices:
            gaps += j.started_at - last_end.get(d, first)
            last_end[d] = j.finished_at
    steady = (steady_end - first) * slots
    gaps += sum(max(0.0, steady_end - last_end.get(f"cpu:{i}", first)) for i in range(slots)
                if last_end.get(f"cpu:{i}", first) < steady_end)
    return {"runs": n, "wall_s": wall, "window_s": window, "per_hour": n / window * 3600,
            "per_device_hour": n / (window * slots) * 3600, "idle_share": 1 - busy / (window * slots),
            "thinking_idle_share": gaps / steady if steady > 0 else 0.0,
            "best": (summary["best"] or {}).get("mean"), "variants": summary["variants"],
            "startup_s": first - t0, "holdout_jobs": len(evals), "holdout_device_s": spent(evals),
            "device_s": busy + spent(evals), "holdout": summary.get("holdout")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--run-seconds", type=float, default=5.0)
    parser.add_argument("--think", type=float, default=0.5, help="seconds the fake LLM takes per answer")
    parser.add_argument("--runs", type=int, default=24, help="jobs in program mode (baseline and re-runs included)")
    parser.add_argument("--seq-runs", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--holdout-seconds", type=float, default=None,
                        help="give program mode's program a holdout evaluator taking this long")
    args = parser.parse_args()
    from tests.agent.fake_llm import FakeLLM

    with tempfile.TemporaryDirectory(prefix="program-bench-") as tmp:
        tmp = Path(tmp)
        (tmp / "home").mkdir()
        with FakeLLM(default=Script(args.think).answer) as fake:
            seq = sequential(make_program(tmp / "seq", args.run_seconds, args.repeats), fake.base_url, args.seq_runs)
        with FakeLLM(default=Script(args.think).answer) as fake:
            program = make_program(tmp / "par", args.run_seconds, args.repeats)
            if args.holdout_seconds is not None:
                add_holdout(program, args.holdout_seconds)
            par = parallel(program, fake.base_url, args.runs, args.slots, tmp / "home")
    ratio = par["per_hour"] / (args.slots * seq["per_hour"])
    print(f"fixed budget per run {args.run_seconds:g} s, LLM think {args.think:g} s, {args.slots} slots")
    print(f"sequential keep/reset: {seq['runs']} runs in {seq['wall_s']:.1f} s -> {seq['per_hour']:.0f} runs/h "
          f"({seq['per_device_hour']:.0f} per device-hour); device idle {seq['idle_share']:.1%}")
    print(f"program mode:          {par['runs']} runs in {par['window_s']:.1f} s (first start to last end; "
          f"+{par['startup_s']:.1f} s start-up) -> {par['per_hour']:.0f} runs/h ({par['per_device_hour']:.0f} per "
          f"device-hour); device idle {par['idle_share']:.1%}; variants {par['variants']}")
    print(f"program mode / ({args.slots} x sequential) = {ratio:.2f} (aim >= 0.9); device idle while the agent "
          f"works (first to last start) {par['thinking_idle_share']:.1%} (aim < 5%)")
    if args.holdout_seconds is not None:
        share = par["holdout_device_s"] / par["device_s"] if par["device_s"] else 0.0
        print(f"holdout: {par['holdout_jobs']} evaluation jobs ({args.holdout_seconds:g} s evaluator), "
              f"{par['holdout_device_s']:.1f} of {par['device_s']:.1f} device-s = {share:.1%} of the session's "
              f"device time (aim < 5%); {par['holdout']}")


if __name__ == "__main__":
    main()
