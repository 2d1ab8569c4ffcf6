"""Config-file experiments without a service: reading autoresearch.toml, every bad file, writing the command,
the registry's names, `submit --experiment DIR`, and the job wrapper run by hand (real processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from experiments import registry
from experiments.command import format_value, render, script_params
from experiments.config_file import ConfigError
from experiments.space import Categorical, Float, Int
from tests.support.own import BOWL_TOML, folder

ROOT = Path(__file__).resolve().parents[2]

GOOD = """
[experiment]
run = "python train.py --out={checkpoint_dir} {args}"
metric = "val_loss"
direction = "minimize"
[space]
lr = { type = "float", low = 1e-4, high = 1e-2, log = true, default = 1e-3 }
"""


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "orchestrator.faces.fastcli", *args], capture_output=True, text=True,
                          env=env, cwd=cwd or ROOT, timeout=120)


def test_the_toml_becomes_one_experiment_spec(tmp_path, home):
    root = folder(tmp_path, BOWL_TOML.format(name="bowl"))
    spec = registry.get(str(root))
    assert (spec.name, spec.metric, spec.direction, spec.cwd, spec.fixed) == \
        ("bowl", "val_loss", "minimize", str(root.resolve()), {"steps": 3})
    dims = spec.space.dims
    assert dims["lr"] == Float(1e-4, 1.0, log=True, default=1e-3)
    assert dims["width"] == Int(2, 64, default=4) and dims["act"] == Categorical(("relu", "gelu"), default="relu")
    assert not spec.seeded  # no seed parameter: re-runs repeat the configuration
    assert registry.get(str(root / "autoresearch.toml")) == spec  # the toml's own path reads the same
    assert registry.get("bowl") == spec  # remembered by name in the home
    job = spec.job_fields()
    assert job["cwd"] == str(root.resolve()) and job["argv"][1:3] == ["-m", "orchestrator.executors.scriptjob"]
    # The bundled experiments are unchanged: a module run from the repository root.
    digits = registry.get("digits")
    assert digits.job_fields()["argv"][1:] == ["-m", "experiments.digits.train"] and digits.seeded


def test_a_second_folder_cannot_take_a_remembered_name(tmp_path, home):
    registry.get(str(folder(tmp_path / "a", BOWL_TOML.format(name="same"))))
    with pytest.raises(ConfigError, match=r"name 'same' is already taken by .*/a/mine/autoresearch.toml"):
        registry.get(str(folder(tmp_path / "b", BOWL_TOML.format(name="same"))))
    with pytest.raises(ConfigError, match="bundled experiment"):
        registry.get(str(folder(tmp_path / "c", BOWL_TOML.format(name="digits"))))
    assert registry.all_names() == ("digits", "charlm", "tabular", "same")


BAD = [  # (what is wrong, the toml's text, what the one line must say)
    ("unknown key", GOOD.replace('metric =', 'metrc = "x"\nmetric ='), "unknown key 'metrc' in [experiment]"),
    ("unknown dim key", GOOD.replace("log = true", "log = true, step = 2"), "[space] lr: unknown key 'step'"),
    ("default out of range", GOOD.replace("default = 1e-3", "default = 0.5"), "[space] lr: default 0.5"),
    ("low >= high", GOOD.replace("low = 1e-4", "low = 1e-2"), "[space] lr: low (0.01) must be below high"),
    ("log through 0", GOOD.replace("low = 1e-4", "low = 0.0"), "[space] lr: a log range must lie above 0"),
    ("pattern without value", GOOD + '', None),  # replaced below (a pattern needs the [experiment] table)
    ("run without args", GOOD.replace(" {args}", ""), "run must pass the parameters: add {args}"),
    ("unknown placeholder", GOOD.replace("{args}", "{args} {lrr}"), "unknown placeholder {lrr}"),
    ("bad type", GOOD.replace('type = "float"', 'type = "real"'), "[space] lr: type must be"),
    ("missing metric", GOOD.replace('metric = "val_loss"\n', ""), "[experiment] needs 'metric'"),
    ("bad direction", GOOD.replace('"minimize"', '"down"'), "direction must be"),
    ("int bounds", GOOD.replace('type = "float", low = 1e-4, high = 1e-2, log = true, default = 1e-3',
                                'type = "int", low = 1.5, high = 4'), "[space] lr: low must be an integer"),
    ("fixed and searched", GOOD.replace('direction =', 'fixed = { lr = 1 }\ndirection ='),
     "fixed lr is also in [space]"),
    ("not toml", "[experiment\n", "not valid TOML"),
    ("unknown placeholder in resume", GOOD.replace('direction =', 'resume = "--from={ckpt}"\ndirection ='),
     "resume has an unknown placeholder {ckpt}"),
    ("dotted key unquoted", GOOD + 'model.lr = { type = "float", low = 0.1, high = 1.0 }\n',
     '[space] model: TOML read model.lr as a table inside model: quote a dotted name, "model.lr"'),
]
BAD[5] = ("pattern without value", GOOD.replace('direction =', "pattern = 'val (\\d+)'\ndirection ="),
          "pattern needs a (?P<value>...) group")


@pytest.mark.parametrize("what,text,message", BAD, ids=[b[0] for b in BAD])
def test_every_bad_toml_is_one_line_naming_the_key(tmp_path, home, what, text, message):
    root = folder(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        registry.get(str(root))
    line = str(caught.value)
    assert message in line and "\n" not in line and str(root) in line


def test_a_missing_file_and_the_cli_exit_code(tmp_path, home):
    with pytest.raises(ConfigError, match="no such file or folder"):
        registry.get(str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="no autoresearch.toml in this folder"):
        registry.get(str(tmp_path))
    bad = folder(tmp_path, GOOD.replace("default = 1e-3", "default = 0.5"))
    out = cli("submit", "--experiment", str(bad), "--json")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "[space] lr: default 0.5" in out.stderr


def test_values_are_written_as_their_type_and_quoted_only_when_needed():
    assert [format_value(v) for v in (0.0, 1e-05, 3e-3, 2, True, False, "gelu")] == \
        ["0.0", "1e-05", "0.003", "2", "True", "False", "gelu"]
    params = script_params({"lr": 1e-05, "seed": 7, "name": "a b"}, {"steps": 200, "flag": False}, "random_state")
    assert render("python t.py --out {checkpoint_dir} {args}", "--{name}={value}", params,
                  checkpoint_dir="/ck/my dir", job_id=5, seed_param="random_state") == \
        "python t.py --out '/ck/my dir' --lr=1e-05 --random_state=7 --name='a b' --steps=200 --flag=False"
    # Hydra style; a parameter placed by name (and the seed by {seed}) is not repeated by {args}.
    assert render("python t.py lr={lr} s={seed} {{x}} {args} +job={job_id}", "{name}={value}", params,
                  checkpoint_dir="/c", job_id=9, seed_param="random_state") == \
        "python t.py lr=1e-05 s=7 {x} name='a b' steps=200 flag=False +job=9"


def test_submit_experiment_dir_queues_the_script_validated(tmp_path, home):
    root = folder(tmp_path, BOWL_TOML.format(name="bowl"))
    out = cli("submit", "--experiment", str(root), "--param", "lr=3e-3", "--param", "act=gelu", "--json")
    assert out.returncode == 0, out.stderr
    job = json.loads(out.stdout)
    assert job["params"] == {"lr": 3e-3, "width": 4, "act": "gelu"} and job["experiment"] == "bowl"
    assert job["cwd"] == str(root.resolve()) and job["argv"][1:3] == ["-m", "orchestrator.executors.scriptjob"]
    bad = cli("submit", "--experiment", str(root), "--param", "lr=5")
    assert bad.returncode == 2 and "parameter 'lr'" in bad.stderr and bad.stderr.count("\n") == 1
    assert cli("submit", "--experiment", "bowl", "--param", "width=65").returncode == 2  # by its name now


def wrapper(spec, params: dict, ckpt: Path, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(ROOT), "AUTORESEARCH_CHECKPOINT_DIR": str(ckpt),
            "AUTORESEARCH_PARAMS": json.dumps(spec.validate(params)), "AUTORESEARCH_JOB_ID": "3", **env}
    for var in ("MLFLOW_RUN_ID",):
        if var not in env:
            full.pop(var, None)
    return subprocess.run(spec.argv(), cwd=spec.cwd, env=full, capture_output=True, text=True, timeout=60)


COUNTER = '''
import argparse, json, os
p = argparse.ArgumentParser()
p.add_argument("--lr", type=float)
p.add_argument("--steps", type=int)
p.add_argument("--ckpt")
p.add_argument("--resume", action="store_true")
a = p.parse_args()
print("params", os.environ["AUTORESEARCH_PARAMS"])
state = os.path.join(a.ckpt, "step")
start = int(open(state).read()) if a.resume and os.path.exists(state) else 0
for step in range(start + 1, start + 3):
    open(state, "w").write(str(step))
    print(f"it {step} loss={a.lr * step}")
'''


def test_the_wrapper_restarts_from_scratch_without_a_resume_flag_and_continues_with_one(tmp_path, home):
    toml = textwrap.dedent("""
        [experiment]
        run = "python train.py --ckpt={checkpoint_dir} {args}"
        metric = "loss"
        direction = "minimize"
        pattern = 'it (?P<step>\\d+) loss=(?P<value>[0-9.e-]+)'
        fixed = { steps = 2 }
        [space]
        lr = { type = "float", low = 0.0, high = 1.0, default = 0.5 }
        """)
    spec = registry.get(str(folder(tmp_path, toml, COUNTER)))
    ckpt = tmp_path / "ck"
    first = wrapper(spec, {}, ckpt)
    assert first.returncode == 0, first.stdout + first.stderr
    assert 'params {"lr": 0.5, "steps": 2}' in first.stdout  # the fixed ones travel too
    again = wrapper(spec, {}, ckpt)
    assert "attempt 2: no resume flag; the checkpoint dir holds what the script left there (step)" in again.stdout
    assert "it 1 loss=0.5" in again.stdout
    from orchestrator.core import outputmetrics

    assert [s for s, _ in outputmetrics.read(ckpt)] == [1, 2, 1, 2]

    resume = 'resume = "--resume --ckpt={checkpoint_dir}"\nfixed'  # its placeholders filled in as in run
    resumable = registry.get(str(folder(tmp_path, toml.replace("fixed", resume), COUNTER, name="resumable")))
    ckpt2 = tmp_path / "ck2"
    wrapper(resumable, {}, ckpt2)
    second = wrapper(resumable, {}, ckpt2)
    assert "resuming from the checkpoint dir" in second.stdout and "it 3 loss=1.5" in second.stdout
    assert f"added '--resume --ckpt={ckpt2}'" in second.stdout
    assert [s for s, _ in outputmetrics.read(ckpt2)] == [1, 2, 3, 4]


def test_a_run_with_no_metric_line_fails_instead_of_scoring(tmp_path, home):
    spec = registry.get(str(folder(tmp_path, GOOD, "import sys; print('training done', sys.argv[1:])")))
    from orchestrator.tracking.client import Tracker
    from orchestrator.core.config import Settings

    tracker = Tracker.from_settings(Settings.load())
    run = tracker.trial_run(None, "x", key="k", name="n", params={}, tags={})
    out = wrapper(spec, {}, tmp_path / "ck", MLFLOW_RUN_ID=run)
    assert out.returncode == 1 and "no result: the run printed no line matching" in out.stdout
    assert f"the job's run {run} has no metric" in out.stdout and "MLFlowLogger(run_id=...)" in out.stdout


def test_a_sweep_yaml_is_read_through_the_sweep_module(tmp_path, home, monkeypatch):
    import types

    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("program: train.py\n")
    fake = types.ModuleType("experiments.sweep")  # the sweep reader is its own module; its contract is the dict

    def read_sweep(path):
        if "bad" in str(path):
            raise ValueError(f"{path}: parameters.lr: distribution 'q_beta' has no equivalent")
        return {"experiment": {"name": "swept", "run": "python train.py {args}", "metric": "val_loss",
                               "direction": "minimize"},
                "space": {"lr": {"type": "float", "low": 0.001, "high": 0.1}}}

    fake.read_sweep = read_sweep
    monkeypatch.setitem(sys.modules, "experiments.sweep", fake)
    spec = registry.get(str(sweep))
    assert spec.name == "swept" and spec.cwd == str(tmp_path.resolve()) and "lr" in spec.space
    bad = tmp_path / "bad.yml"
    bad.write_text("x: 1\n")
    with pytest.raises(ConfigError, match="distribution 'q_beta' has no equivalent"):
        registry.get(str(bad))


def test_the_example_folder_reads_and_its_script_runs_alone(tmp_path, home):
    spec = registry.get(str(ROOT / "examples" / "tinyreg"))
    assert spec.name == "tinyreg" and spec.seeded and spec.resume == "--resume"
    out = wrapper(spec, {"degree": 2}, tmp_path / "ck")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "--degree=2" in out.stdout and "--lr=0.05" in out.stdout and "--seed=0" in out.stdout
    from orchestrator.core import outputmetrics

    reports = outputmetrics.read(tmp_path / "ck")
    assert [s for s, _ in reports] == list(range(20, 201, 20)) and reports[-1][1] < reports[0][1]


def test_a_holdout_metric_is_declared_apart_from_the_searched_one(tmp_path):
    from experiments import config_file

    folder = tmp_path / "held"
    folder.mkdir()
    body = ('[experiment]\nrun = "python train.py {args}"\nmetric = "val_loss"\ndirection = "minimize"\n'
            'holdout_metric = "HELD"\n[space]\nlr = { type = "float", low = 0.001, high = 0.1, default = 0.01 }\n')
    (folder / "autoresearch.toml").write_text(body.replace("HELD", "test_loss"))
    spec = config_file.load(folder)
    assert spec.holdout_metric == "test_loss" and "test_loss" not in spec.search_metrics
    (folder / "autoresearch.toml").write_text(body.replace("HELD", "val_loss"))
    with pytest.raises(config_file.ConfigError, match="holdout_metric"):
        config_file.load(folder)


def test_bools_are_written_as_the_toml_says(tmp_path):
    from experiments import command, config_file

    folder = tmp_path / "flags"
    folder.mkdir()
    body = ('[experiment]\nrun = "python train.py {args}"\nmetric = "loss"\ndirection = "minimize"\nBOOLS\n'
            '[space]\namp = { type = "choice", values = [true, false], default = true }\n')
    (folder / "autoresearch.toml").write_text(body.replace("BOOLS", ""))
    spec = config_file.load(folder)
    line = command.render(spec.run, spec.args_format, {"amp": False}, checkpoint_dir="/c", job_id=1, bools=spec.bools)
    assert line == "python train.py --amp=False"  # the default: Python's words
    (folder / "autoresearch.toml").write_text(body.replace("BOOLS", 'bools = ["true", "false"]'))
    spec = config_file.load(folder)
    line = command.render(spec.run, spec.args_format, {"amp": True}, checkpoint_dir="/c", job_id=1, bools=spec.bools)
    assert line == "python train.py --amp=true"
    assert '"bools":["true","false"]' in spec.argv()[-1]  # the job's wrapper writes them the same way
    for bad in ('bools = ["yes"]', 'bools = ["on", "on"]', 'bools = "true"'):
        (folder / "autoresearch.toml").write_text(body.replace("BOOLS", bad))
        with pytest.raises(config_file.ConfigError, match="bools"):
            config_file.load(folder)


def test_a_command_is_read_as_sh_reads_it():
    """Leading assignments stay before `exec` (`exec A=1 python` is no command); the warm path expands the words
    and assignments with /bin/sh itself: parameters in the caller's variables, assignments in order."""
    from experiments.command import exec_form, expand, with_interpreter

    command = with_interpreter("OMP_NUM_THREADS=1 X='a b' python t.py --id=$JOB \"$X\"", "/py")
    assert command == "OMP_NUM_THREADS=1 X='a b' /py t.py --id=$JOB \"$X\""
    assert exec_form(command) == "OMP_NUM_THREADS=1 X='a b' exec /py t.py --id=$JOB \"$X\""
    assert exec_form("python a.py | tee log") == "python a.py | tee log"
    argv, assigned = expand(command, {"JOB": "7", "X": "outer", "PATH": os.environ["PATH"]})
    assert argv == ["/py", "t.py", "--id=7", "outer"] and assigned == {"OMP_NUM_THREADS": "1", "X": "a b"}
    with pytest.raises(ValueError):
        expand("python a.py && echo done", {})


MAKES_ITS_OWN_RUNS = '''
import mlflow
with mlflow.start_run():  # the job's run (MLFLOW_RUN_ID), which MLflow then forgets
    mlflow.log_metric("train_loss", 1.0, step=1)
with mlflow.start_run():  # a run of its own, as the Trainer's evaluate() after train() makes
    mlflow.log_metric("val_loss", 0.25, step=7)
'''


def test_metrics_a_script_logs_to_runs_of_its_own_land_in_the_job_run(tmp_path, home):
    from orchestrator.core.config import Settings
    from orchestrator.tracking.client import Tracker

    spec = registry.get(str(folder(tmp_path, GOOD, MAKES_ITS_OWN_RUNS)))
    tracker = Tracker.from_settings(Settings.load())
    run = tracker.trial_run(None, "x", key="k", name="n", params={}, tags={})
    uri = Settings.load().tracking_uri
    out = wrapper(spec, {}, tmp_path / "ck", MLFLOW_RUN_ID=run, MLFLOW_TRACKING_URI=uri)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "the script made MLflow runs of its own" in out.stdout and "copied val_loss" in out.stdout
    assert tracker.history(run, "val_loss") == [(7, 0.25)] and tracker.history(run, "train_loss") == [(1, 1.0)]
    import sqlite3

    with sqlite3.connect(uri[len("sqlite:///"):]) as db:
        live = db.execute("SELECT COUNT(*) FROM runs WHERE lifecycle_stage = 'active'").fetchone()[0]
    assert live == 1  # the job's run only: the one the script made was deleted
