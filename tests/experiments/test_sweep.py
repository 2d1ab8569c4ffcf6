"""W&B sweep files read into the autoresearch.toml schema (experiments/sweep.py): what maps, field by field, and
every thing that cannot map refused with one line naming its key."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pytest

from experiments.space import Categorical, Float, Int, SearchSpace
from experiments.sweep import SweepError, read_sweep

TYPICAL = """\
program: train.py
method: bayes
name: mlp-sweep
description: an MLP on digits
project: digits
metric:
  name: val_loss
  goal: minimize
early_terminate:
  type: hyperband
  min_iter: 3
parameters:
  learning_rate:
    distribution: log_uniform_values
    min: 1e-4
    max: 1e-2
  width:
    distribution: int_uniform
    min: 16
    max: 256
  layers:
    min: 1
    max: 6
  dropout:
    min: 0.0
    max: 0.3
  batch_size:
    distribution: q_log_uniform_values
    q: 1
    min: 16
    max: 256
  activation:
    values: [relu, gelu]
  epochs:
    value: 5
command:
  - ${env}
  - ${interpreter}
  - ${program}
  - --data
  - ./my data
  - ${args}
"""


def write(folder: Path, text: str, program: str | None = "train.py") -> Path:
    if program:
        (folder / program).write_text("print('val_loss: 0.5')\n")
    path = folder / "sweep.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def as_space(entries: dict) -> SearchSpace:
    """The toml schema's [space] as the SearchSpace the loader builds: proves the dict's shape and defaults."""
    made = {}
    for name, e in entries.items():
        if e["type"] == "choice":
            made[name] = Categorical(tuple(e["values"]), default=e["default"])
        else:
            cls = Float if e["type"] == "float" else Int
            made[name] = cls(e["low"], e["high"], log=e["log"], default=e["default"])
    return SearchSpace(made)


def test_a_typical_sweep_maps_field_by_field(tmp_path):
    got = read_sweep(write(tmp_path, TYPICAL))
    assert got["experiment"] == {
        "name": "mlp-sweep",
        "description": "an MLP on digits",
        "run": "python train.py --data './my data' {args}",
        "args": "--{name}={value}",
        "metric": "val_loss",
        "direction": "minimize",
        "fixed": {"epochs": 5},
    }
    assert got["space"] == {
        "learning_rate": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True, "default": 1e-3},
        "width": {"type": "int", "low": 16, "high": 256, "log": False, "default": 136},
        "layers": {"type": "int", "low": 1, "high": 6, "log": False, "default": 3},
        "dropout": {"type": "float", "low": 0.0, "high": 0.3, "log": False, "default": 0.15},
        "batch_size": {"type": "int", "low": 16, "high": 256, "log": True, "default": 64},
        "activation": {"type": "choice", "values": ["relu", "gelu"], "default": "relu"},
    }
    space = as_space(got["space"])
    assert space.validate(space.defaults()) == {k: v["default"] for k, v in got["space"].items()}
    assert set(got) == {"experiment", "space"}
    assert isinstance(got["space"]["dropout"]["low"], float) and isinstance(got["space"]["width"]["low"], int)


def test_default_command_maximize_and_folder_name(tmp_path):
    folder = tmp_path / "mnist"
    folder.mkdir()
    got = read_sweep(write(folder, """\
        program: train.py
        metric: {name: val_accuracy, goal: maximize}
        parameters:
          lr: {min: 0.001, max: 0.1, distribution: uniform}
    """))
    exp = got["experiment"]
    assert (exp["run"], exp["args"], exp["direction"], exp["name"]) == (
        "python train.py {args}", "--{name}={value}", "maximize", "mnist")
    assert exp["fixed"] == {} and "val_accuracy" in exp["description"]


def test_goal_defaults_to_minimize_and_args_no_hyphens_is_hydra_style(tmp_path):
    got = read_sweep(write(tmp_path, """\
        program: train.py
        metric: {name: loss}
        command: [python, "${program}", "${args_no_hyphens}"]
        parameters:
          optimizer.lr: {values: [0.1, 0.01]}
    """))
    assert got["experiment"]["direction"] == "minimize"
    assert got["experiment"]["args"] == "{name}={value}"
    assert got["space"]["optimizer.lr"] == {"type": "choice", "values": [0.1, 0.01], "default": 0.1}


def test_exponent_bounds_quantized_laws_and_one_value_lists(tmp_path):
    got = read_sweep(write(tmp_path, f"""\
        program: train.py
        metric: {{name: loss}}
        parameters:
          lr: {{distribution: log_uniform, min: {math.log(1e-4)}, max: {math.log(1e-2)}}}
          decay: {{distribution: inv_log_uniform_values, min: 0.001, max: 0.1}}
          batch: {{distribution: q_log_uniform, q: 1, min: {math.log(32)}, max: {math.log(256)}}}
          wd: {{distribution: q_uniform, min: 0, max: 0.1, q: 0.025}}
          heads: {{distribution: q_uniform, min: 1, max: 8, q: 1}}
          layers: {{values: [4]}}
          amp: {{value: true}}
    """))
    space = got["space"]
    assert space["lr"] == {"type": "float", "low": 1e-4, "high": 1e-2, "log": True, "default": 1e-3}
    assert space["decay"] == {"type": "float", "low": 0.001, "high": 0.1, "log": True, "default": 0.01}
    assert space["batch"] == {"type": "int", "low": 32, "high": 256, "log": True, "default": 91}
    assert space["wd"] == {"type": "choice", "values": [0.0, 0.025, 0.05, 0.075, 0.1], "default": 0.05}
    assert space["heads"] == {"type": "int", "low": 1, "high": 8, "log": False, "default": 4}
    assert got["experiment"]["fixed"] == {"layers": 4, "amp": True}
    as_space(space)


BASE = "program: train.py\nmetric: {name: loss}\n"
REFUSED = [
    ("nested", BASE + "parameters:\n  opt:\n    parameters:\n      lr: {value: 1}\n", "parameters.opt.parameters"),
    ("weighted", BASE + "parameters:\n  a: {values: [1, 2], probabilities: [0.5, 0.5]}\n",
     "parameters.a.probabilities"),
    ("normal", BASE + "parameters:\n  a: {distribution: normal, mu: 0, sigma: 1}\n", "parameters.a.mu"),
    ("normal-bare", BASE + "parameters:\n  a: {distribution: normal}\n", "parameters.a.distribution"),
    ("beta", BASE + "parameters:\n  a: {distribution: beta}\n", "parameters.a.distribution"),
    ("unknown-top", BASE + "paramters: {}\nparameters:\n  a: {value: 1}\n", "paramters"),
    ("unknown-param-key", BASE + "parameters:\n  a: {min: 1, max: 2, step: 1}\n", "parameters.a.step"),
    ("early-terminate", BASE + "early_terminate: {type: envelope}\nparameters:\n  a: {value: 1}\n",
     "early_terminate.type"),
    ("method", BASE + "method: custom\nparameters:\n  a: {value: 1}\n", "method"),
    ("args-json", BASE + "command: [python, train.py, '${args_json}']\nparameters:\n  a: {value: 1}\n", "command"),
    ("envvar", BASE + "command: [python, train.py, '${envvar:HOME}', '${args}']\nparameters:\n  a: {value: 1}\n",
     "command"),
    ("no-args", BASE + "command: [python, train.py]\nparameters:\n  a: {min: 1, max: 2}\n", "command"),
    ("bool-flags", BASE + "command: [python, train.py, '${args_no_boolean_flags}']\nparameters:\n"
     "  amp: {values: [true, false]}\n", "command"),
    ("no-metric", "program: train.py\nparameters:\n  a: {value: 1}\n", "metric"),
    ("goal", "program: train.py\nmetric: {name: loss, goal: lower}\nparameters:\n  a: {value: 1}\n", "metric.goal"),
    ("no-parameters", BASE, "parameters"),
    ("min-not-below-max", BASE + "parameters:\n  a: {min: 2, max: 2}\n", "parameters.a.min"),
    ("log-through-zero", BASE + "parameters:\n  a: {distribution: log_uniform_values, min: 0, max: 1}\n",
     "parameters.a.min"),
    ("log-quantized", BASE + "parameters:\n  a: {distribution: q_log_uniform_values, min: 1, max: 100, q: 5}\n",
     "parameters.a.q"),
    ("exponent-overflow", BASE + "parameters:\n  a: {distribution: log_uniform, min: 0, max: 1000}\n",
     "parameters.a.max"),
    ("too-many-multiples", BASE + "parameters:\n  a: {distribution: q_uniform, min: 0, max: 1, q: 0.001}\n",
     "parameters.a.q"),
    ("int-float-bounds", BASE + "parameters:\n  a: {distribution: int_uniform, min: 0.5, max: 3}\n",
     "parameters.a.min"),
    ("only-min", BASE + "parameters:\n  a: {min: 1}\n", "parameters.a.max"),
    ("null-value", BASE + "parameters:\n  a: {value: null}\n", "parameters.a.value"),
    ("list-value", BASE + "parameters:\n  a: {values: [[1, 2], [3]]}\n", "parameters.a.values"),
    ("launch-job", BASE + "job: wandb/proj/job:v0\nparameters:\n  a: {value: 1}\n", "job"),
    ("program-missing", "program: absent.py\nmetric: {name: loss}\nparameters:\n  a: {value: 1}\n", "program"),
    ("program-unnamed", "metric: {name: loss}\nparameters:\n  a: {value: 1}\n", "program"),
]


@pytest.mark.parametrize("text,key", [(t, k) for _, t, k in REFUSED], ids=[i for i, _, _ in REFUSED])
def test_what_cannot_be_mapped_is_one_line_naming_the_key(tmp_path, text, key):
    path = write(tmp_path, text)
    with pytest.raises(SweepError) as caught:
        read_sweep(path)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"sweep.yaml: {key}: "), message
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize("text,words", [
    ("program: [unclosed\n", "not valid YAML at line"),
    ("- a list\n", "is a mapping"),
])
def test_unreadable_files(tmp_path, text, words):
    with pytest.raises(SweepError, match=words):
        read_sweep(write(tmp_path, text, program=None))


def test_missing_file(tmp_path):
    with pytest.raises(SweepError, match="no such file"):
        read_sweep(tmp_path / "absent.yaml")
