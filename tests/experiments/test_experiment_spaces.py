"""The bundled experiments' specs: registry lookup, defaults, and params validation naming key and range."""

import json
import subprocess
import sys

import pytest

from experiments import registry
from experiments.space import SpaceError


@pytest.mark.parametrize("name", registry.names())
def test_registry_finds_spec_without_importing_torch(name):
    # submit validates on its fast path: the spec must not drag torch in.
    code = (f"import sys; from experiments import registry; s = registry.get({name!r}); "
            "assert 'torch' not in sys.modules, 'spec imported torch'; print(s.metric, s.direction)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    spec = registry.get(name)
    assert out.stdout.split() == [spec.metric, spec.direction]
    assert spec.progress_metric
    assert spec.argv()[-1] == f"experiments.{name}.train"


@pytest.mark.parametrize("name", registry.names())
def test_defaults_are_valid_and_complete(name):
    spec = registry.get(name)
    defaults = spec.space.defaults()
    assert spec.validate(defaults) == defaults
    assert {"seed", "lr", "batch_size", "scale"} <= defaults.keys()
    assert {k: defaults[k] for k in spec.budget} == dict(spec.budget)  # the agent holds these fixed
    for row in spec.space.describe():  # what the agent's prompt shows: every dimension explained by its range
        assert row["range"]


@pytest.mark.parametrize("name,raw,key,says", [
    ("charlm", {"layer": 3}, "layer", "unknown parameter"),
    ("charlm", {"layers": "two"}, "layers", "integer in [1, 16]"),
    ("charlm", {"lr": "1.0"}, "lr", "out of range"),
    ("charlm", {"activation": "tanh"}, "activation", "'gelu', 'relu', 'swiglu'"),
    ("charlm", {"tied": "maybe"}, "tied", "True, False"),
    ("charlm", {"max_steps": 0}, "max_steps", "integer in [1, 1000000]"),
    ("digits", {"channels": 8}, "channels", None),  # inactive for the default mlp: dropped, not an error
    ("digits", {"arch": "resnet"}, "arch", "'mlp', 'cnn'"),
    ("digits", {"dropout": 0.9}, "dropout", "float in [0, 0.5]"),
    ("digits", {"epochs": 2.5}, "epochs", "integer in [1, 200]"),
    ("digits", {"optimiser": "sgd"}, "optimiser", "unknown parameter"),
])
def test_bad_params_name_the_key_and_range(name, raw, key, says):
    spec = registry.get(name)
    if says is None:
        assert key not in spec.validate(raw)
        return
    with pytest.raises(SpaceError) as err:
        spec.validate(raw)
    assert err.value.key == key
    assert repr(key) in str(err.value) and says in str(err.value)


def test_conditional_params_follow_their_parent():
    spec = registry.get("digits")
    cnn = spec.validate({"arch": "cnn", "optimizer": "sgd", "momentum": "0.5"})
    assert cnn["channels"] == 16 and cnn["momentum"] == 0.5
    assert "hidden" not in cnn and "depth" not in cnn
    assert "momentum" not in spec.validate({"optimizer": "adamw"})


def test_cli_strings_coerce():
    params = registry.get("charlm").validate({"tied": "false", "width": "96", "positions": "rope"})
    assert params["tied"] is False and params["width"] == 96 and params["positions"] == "rope"


@pytest.mark.parametrize("args,says", [
    (["--experiment", "charlm", "--param", "layers=99"],
     "parameter 'layers': '99' is out of range: expected an integer in [1, 16]"),
    (["--experiment", "digits", "--param", "lr=fast"], "parameter 'lr'"),
    (["--experiment", "digits", "--param", "arch=resnet"], "one of 'mlp', 'cnn'"),
])
def test_cli_rejects_bad_params_with_exit_2_and_queues_nothing(home, args, says):
    cli = [sys.executable, "-m", "orchestrator.faces.cli"]
    bad = subprocess.run([*cli, "submit", *args, "--json"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2, bad.stderr
    assert says in bad.stderr and len(bad.stderr.strip().splitlines()) == 1  # one line, no traceback
    listed = subprocess.run([*cli, "queue", "--all", "--json"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and json.loads(listed.stdout) == []
