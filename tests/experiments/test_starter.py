"""`autoresearch init`: a starter autoresearch.toml from a third-party script's argparse / click / typer options
(experiments/starter.py), the script stopped at its parser; and the command end to end."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from experiments.starter import StarterError, build_starter, starter_toml, write_starter

PY = sys.executable
ROOT = Path(__file__).resolve().parents[2]

# Written as a third party would: no import of ours. Everything after parse_args would leave a trace.
ARGPARSE = '''\
"""Train a tiny MLP on digits."""
import argparse, atexit, json, pathlib, sys

atexit.register(lambda: pathlib.Path("EXITED").write_text("atexit ran"))
parser = argparse.ArgumentParser(description="Train a tiny MLP\\non digits.")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--width", type=int, default=128)
parser.add_argument("--layers", type=int, default=2)
parser.add_argument("--dropout", type=float, default=0.1)
parser.add_argument("--activation", choices=["relu", "gelu"], default="gelu")
parser.add_argument("--heads", type=int, choices=range(1, 9), default=4)
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--out_dir", default="out")
parser.add_argument("--data", default="data")
parser.add_argument("--amp", action="store_true")
parser.add_argument("--num_workers", type=int, default=4)
parser.add_argument("--tags", nargs="+", default=[])
try:
    args = parser.parse_args()
finally:
    pathlib.Path("FINALLY").write_text("finally ran")
pathlib.Path("TRAINED").write_text(json.dumps(vars(args)))
print(f"val_loss: {args.lr * 100:.4f}")
'''

CLICK = '''\
import json, pathlib
import click

@click.command(help="Fine-tune a model.")
@click.option("--learning-rate", "-l", type=float, default=1e-3)
@click.option("--batch-size", type=click.IntRange(8, 256), default=32)
@click.option("--optimizer", type=click.Choice(["adam", "sgd"]), default="adam")
@click.option("--max-steps", type=int, default=100)
@click.option("--amp/--no-amp", default=False)
@click.option("--output-dir", type=click.Path(), default="out")
def train(learning_rate, batch_size, optimizer, max_steps, amp, output_dir):
    pathlib.Path("TRAINED").write_text(json.dumps(dict(learning_rate=learning_rate, batch_size=batch_size,
        optimizer=optimizer, max_steps=max_steps, output_dir=output_dir)))

if __name__ == "__main__":
    train()
'''

TYPER = '''\
import enum, pathlib
import typer

class Act(str, enum.Enum):
    relu = "relu"
    gelu = "gelu"

def main(lr: float = 0.01, n_layer: int = 4, act: Act = Act.gelu, compile: bool = False):
    """Train with typer."""
    pathlib.Path("TRAINED").write_text("trained")

if __name__ == "__main__":
    typer.run(main)
'''


def script(folder: Path, source: str, name: str = "train.py") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(textwrap.dedent(source))
    return path


def traces(folder: Path) -> set[str]:
    return {p for p in ("TRAINED", "FINALLY", "EXITED") if (folder / p).exists()}


def run_as_toml_says(folder: Path, toml: dict, ckpt: Path) -> dict:
    """Run the toml's `run` with every parameter at its default, as a job would (the shell, in the toml's folder):
    proves the flags are spelled the way the script's parser reads them. Returns what the script parsed."""
    exp, space = toml["experiment"], toml["space"]
    params = {**{k: v["default"] for k, v in space.items()}, **exp.get("fixed", {})}
    args = " ".join(exp["args"].format(name=k, value=shlex.quote(str(v))) for k, v in params.items())
    command = exp["run"].format(args=args, checkpoint_dir=ckpt, **params)
    subprocess.run(command, shell=True, cwd=folder, check=True, capture_output=True, timeout=60)
    return json.loads((folder / "TRAINED").read_text())


@pytest.fixture(scope="module")
def argparse_toml(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mlp")
    script(folder, ARGPARSE)
    text = starter_toml([PY, "train.py"], folder)
    return folder, text, tomllib.loads(text)


def test_argparse_script_becomes_a_starter_toml(argparse_toml):
    folder, text, toml = argparse_toml
    exp, space = toml["experiment"], toml["space"]
    assert exp["name"] == folder.name
    assert exp["description"] == "Train a tiny MLP on digits."
    assert exp["run"] == f"{PY} train.py --out_dir={{checkpoint_dir}} {{args}}"
    assert exp["args"] == "--{name}={value}"
    assert exp["fixed"] == {"epochs": 5} and exp["seed"] == "seed"  # the seed is the product's to give, not fixed
    assert (exp["metric"], exp["direction"]) == ("val_loss", "minimize")  # guessed from its print, to review
    assert "# pattern = " in text
    assert {k: v["type"] for k, v in space.items()} == {
        "lr": "float", "width": "int", "layers": "int", "dropout": "float", "activation": "choice", "heads": "int"}
    assert {k: v["default"] for k, v in space.items()} == {
        "lr": 3e-3, "width": 128, "layers": 2, "dropout": 0.1, "activation": "gelu", "heads": 4}
    for name, entry in space.items():
        if entry["type"] != "choice":
            assert entry["low"] <= entry["default"] <= entry["high"] and entry["low"] < entry["high"], name
            assert type(entry["low"]) is type(entry["default"]) is type(entry["high"]), name
    assert space["lr"]["log"] is True and space["width"]["log"] is True
    assert (space["heads"]["low"], space["heads"]["high"]) == (1, 8)  # choices=range(1, 9): its own bounds
    assert space["activation"]["values"] == ["relu", "gelu"]
    assert all(line.endswith("# review") for line in text.splitlines() if line.split(" = ")[0] in space)
    for note in ("--data", "--amp", "--num_workers", "--tags"):  # not searchable: comments only
        assert any(line.startswith("# " + note) for line in text.splitlines()), note


def test_the_script_never_runs_past_its_parser(argparse_toml):
    folder, _, _ = argparse_toml
    assert traces(folder) == set()  # not the body, not its finally, not its atexit
    assert sorted(p.name for p in folder.iterdir()) == ["train.py"]


def test_the_toml_run_command_is_read_by_the_script(argparse_toml, tmp_path):
    folder, _, toml = argparse_toml
    parsed = run_as_toml_says(folder, toml, tmp_path / "ckpt")
    assert parsed["out_dir"] == str(tmp_path / "ckpt")
    assert {k: parsed[k] for k in ("lr", "width", "activation", "epochs", "seed")} == {
        "lr": 3e-3, "width": 128, "activation": "gelu", "epochs": 5, "seed": 0}


def test_click_dashed_flags_are_placed_with_their_own_spelling(tmp_path):
    folder = tmp_path / "ft"
    script(folder, CLICK)
    toml = tomllib.loads(starter_toml([PY, "train.py"], folder))
    exp, space = toml["experiment"], toml["space"]
    assert traces(folder) == set()
    assert exp["run"] == (f"{PY} train.py --output-dir={{checkpoint_dir}} --learning-rate={{learning_rate}} "
                          "--batch-size={batch_size} --optimizer={optimizer} --max-steps={max_steps}")
    assert "args" not in exp and "{args}" not in exp["run"]
    assert exp["fixed"] == {"max_steps": 100}
    assert space == {
        "learning_rate": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True, "default": 1e-3},
        "batch_size": {"type": "int", "low": 8, "high": 256, "default": 32},  # click.IntRange's own bounds
        "optimizer": {"type": "choice", "values": ["adam", "sgd"], "default": "adam"},
    }
    toml["experiment"]["args"] = "{name}={value}"  # unused by this run (no {args}); the helper needs one
    parsed = run_as_toml_says(folder, toml, tmp_path / "ckpt")
    assert parsed == {"learning_rate": 1e-3, "batch_size": 32, "optimizer": "adam", "max_steps": 100,
                      "output_dir": str(tmp_path / "ckpt")}


def test_typer_app(tmp_path):
    folder = tmp_path / "ty"
    script(folder, TYPER)
    toml = tomllib.loads(starter_toml([PY, "train.py"], folder))
    assert traces(folder) == set()
    assert toml["experiment"]["run"] == f"{PY} train.py --lr={{lr}} --n-layer={{n_layer}} --act={{act}}"
    assert {k: (v["type"], v["default"]) for k, v in toml["space"].items()} == {
        "lr": ("float", 0.01), "n_layer": ("int", 4), "act": ("choice", "gelu")}


def test_options_given_in_the_command_stay_as_given(tmp_path):
    folder = tmp_path / "given"
    script(folder / "src", ARGPARSE)
    starter = build_starter([PY, "src/train.py", "--epochs", "2", "--lr=0.01"], folder)
    toml = tomllib.loads(starter.text)
    assert starter.path == folder / "src" / "autoresearch.toml"  # next to the script; `run` runs there
    assert toml["experiment"]["run"] == f"{PY} train.py --epochs 2 --lr=0.01 --out_dir={{checkpoint_dir}} {{args}}"
    assert "lr" not in toml["space"] and "epochs" not in toml["experiment"].get("fixed", {})


def test_sub_commands_are_followed_or_named(tmp_path):
    folder = tmp_path / "sub"
    script(folder, """\
        import argparse
        parser = argparse.ArgumentParser()
        sub = parser.add_subparsers(dest="cmd")
        fit = sub.add_parser("fit")
        fit.add_argument("--lr", type=float, default=0.1)
        sub.add_parser("eval")
        parser.parse_args()
    """)
    with pytest.raises(StarterError, match=r"sub-commands \(eval, fit\): name one"):
        starter_toml([PY, "train.py"], folder)
    toml = tomllib.loads(starter_toml([PY, "train.py", "fit"], folder))
    assert toml["experiment"]["run"] == f"{PY} train.py fit {{args}}" and list(toml["space"]) == ["lr"]


@pytest.mark.parametrize("source,timeout,words", [
    ("print('no parser here')\n", 30, "ended without building an argparse, click or typer parser"),
    ("import not_a_module_anywhere\n", 30, "failed before building its parser (exit 1): ModuleNotFoundError"),
    ("import time\ntime.sleep(120)\n", 1.5, "built no parser within 1.5 s"),
])
def test_a_script_that_builds_no_parser_is_one_line(tmp_path, source, timeout, words):
    script(tmp_path, source)
    with pytest.raises(StarterError) as caught:
        starter_toml([PY, "train.py"], tmp_path, timeout=timeout)
    assert words in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("argv,words", [
    ([], "give the command"), ([PY, "absent.py"], "no such file"), ([PY, "-c", "pass"], "python -c"),
    (["make", "train"], "cannot tell which Python script"),
])
def test_bad_commands(tmp_path, argv, words):
    with pytest.raises(StarterError, match=words):
        starter_toml(argv, tmp_path)


def test_write_refuses_to_overwrite_unless_forced(tmp_path):
    script(tmp_path, ARGPARSE)
    (tmp_path / "autoresearch.toml").write_text("[program]\n")
    with pytest.raises(StarterError, match="exists: --force replaces it"):
        write_starter([PY, "train.py"], tmp_path)
    assert (tmp_path / "autoresearch.toml").read_text() == "[program]\n"
    assert "[space]" in write_starter([PY, "train.py"], tmp_path, force=True).read_text()


def cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AUTORESEARCH_HOME": str(cwd / ".home"),
           "PATH": os.path.dirname(PY) + os.pathsep + os.environ.get("PATH", "")}  # `python`: this venv's
    return subprocess.run([PY, "-m", "orchestrator.faces.fastcli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def test_cli_end_to_end(tmp_path):
    script(tmp_path, ARGPARSE)
    done = cli(["init", "--", "python", "train.py"], tmp_path)
    assert done.returncode == 0, done.stderr
    written = tmp_path / "autoresearch.toml"
    assert done.stdout.strip() == str(written)
    toml = tomllib.loads(written.read_text())
    assert toml["experiment"]["run"] == "python train.py --out_dir={checkpoint_dir} {args}"
    before = written.read_text()

    again = cli(["init", "--", "python", "train.py"], tmp_path)
    assert again.returncode == 2 and len(again.stderr.strip().splitlines()) == 1
    assert "exists: --force" in again.stderr and written.read_text() == before

    (tmp_path / "empty.py").write_text("print('hello')\n")
    bad = cli(["init", "--print", "--", "python", "empty.py"], tmp_path)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [
        "autoresearch: empty.py ended without building an argparse, click or typer parser: write autoresearch.toml "
        "by hand (see docs/guides/init-and-sweeps.md)"]
    assert traces(tmp_path) == set()


def test_the_starter_is_accepted_as_is(tmp_path):
    """What init writes loads as an experiment without an edit: a --seed option is the seed, not also fixed."""
    from experiments.config_file import load

    script(tmp_path, "import argparse\np = argparse.ArgumentParser()\np.add_argument('--lr', type=float, "
                     "default=0.1)\np.add_argument('--seed', type=int, default=1)\n"
                     "p.add_argument('--adam_beta2', type=float, default=0.999)\np.parse_args()\n")
    spec = load(write_starter([PY, "train.py"], tmp_path))
    assert spec.seed_param == "seed" and "seed" not in spec.fixed and spec.metric == "val_loss"
    beta = spec.space.dims["adam_beta2"]
    assert 0 < beta.low < 0.999 < beta.high < 1  # a beta stays below 1
