"""The typed search space: coercion, ranges, conditions and clear errors."""

import pytest

from experiments.space import Categorical, Float, Int, SearchSpace, SpaceError

SPACE = SearchSpace({
    "lr": Float(1e-4, 1e-1, log=True, default=3e-3),
    "layers": Int(1, 8, default=2),
    "activation": Categorical(("gelu", "relu", "swiglu"), default="gelu"),
    "mlp_ratio": Int(2, 4, default=4, when=("activation", ("gelu", "relu"))),
    "tied": Categorical((True, False), default=True),
})


def test_defaults_fill_and_conditions_drop_inactive():
    assert SPACE.defaults() == {"lr": 3e-3, "layers": 2, "activation": "gelu", "mlp_ratio": 4, "tied": True}
    assert "mlp_ratio" not in SPACE.validate({"activation": "swiglu"})


def test_cli_strings_are_coerced():
    out = SPACE.validate({"lr": "0.01", "layers": "3", "activation": "relu", "tied": "false"})
    assert out["lr"] == 0.01 and out["layers"] == 3 and out["tied"] is False


@pytest.mark.parametrize("raw,key", [
    ({"nope": 1}, "nope"), ({"lr": 1.0}, "lr"), ({"lr": "abc"}, "lr"), ({"layers": 2.5}, "layers"),
    ({"layers": 0}, "layers"), ({"activation": "tanh"}, "activation"), ({"lr": float("nan")}, "lr"),
    ({"layers": True}, "layers"), ({"lr": "rm -rf /"}, "lr"),
])
def test_invalid_values_name_the_key_and_range(raw, key):
    with pytest.raises(SpaceError) as err:
        SPACE.validate(raw)
    assert err.value.key == key
    assert key in str(err.value)


def test_suggest_respects_conditions_with_optuna():
    import optuna

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(20):
        trial = study.ask()
        params = SPACE.suggest(trial)
        assert SPACE.validate(params) == params
        study.tell(trial, 0.0)
