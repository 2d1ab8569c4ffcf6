"""A few real training steps of each experiment, in process: the loss goes down, metrics reach MLflow,
and every architecture switch builds and trains."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from experiments import registry  # noqa: E402
from runtime.context import ContextConfig, JobContext  # noqa: E402

@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """One AUTORESEARCH_HOME for the module: the MLflow store's schema and the data volumes cost seconds
    to create, and these tests only add runs to them."""
    root = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AUTORESEARCH_HOME", str(root))
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
        for var in ("AUTORESEARCH_VOLUMES", "AUTORESEARCH_DB_URL", "MLFLOW_RUN_ID"):
            mp.delenv(var, raising=False)
        yield root


TINY_CHARLM = {"layers": 1, "heads": 2, "width": 32, "block_size": 32, "batch_size": 8, "lr": 0.01,
               "max_steps": 30}


def run_trial(name: str, params: dict, ckpt_dir, home):
    """Train one trial in this process; return {metric: [values by step]} read back from MLflow."""
    from mlflow.tracking import MlflowClient

    module = __import__(f"experiments.{name}.train", fromlist=["train"])
    spec = registry.get(name)
    ctx = JobContext(job_id=None, attempt=0, params=params, checkpoint_dir=ckpt_dir,
                     tracking_uri=f"sqlite:///{home / 'mlflow.db'}", config=ContextConfig(handle_signals=False))
    try:
        module.train(ctx, spec.validate(params))
    finally:
        ctx.close()
    client = MlflowClient(tracking_uri=ctx.tracking_uri)
    run = client.get_run(ctx.run_id)
    return {key: [m.value for m in sorted(client.get_metric_history(ctx.run_id, key), key=lambda m: m.step)]
            for key in run.data.metrics}, run.data.params


def test_charlm_few_steps_lower_the_loss(home, tmp_path):
    metrics, params = run_trial("charlm", TINY_CHARLM, tmp_path / "ckpt", home)
    val = metrics["val_loss"]
    assert len(val) == 10  # one value per eval: what early stopping reads
    assert val[0] < math.log(256)  # below uniform over 256 bytes (ln 256 = 5.545) after the first eval
    assert val[-1] < val[0] - 0.5, val
    assert metrics["train_loss"][-1] < metrics["train_loss"][0]
    assert metrics["val_bpb"][-1] == pytest.approx(val[-1] / 0.6931471805599453)
    assert params["model_width"] == "32" and int(params["model_params"]) > 0
    # The holdout is scored once, at the end, on other files: close to validation, never the same number.
    assert len(metrics["test_loss"]) == 1 and abs(metrics["test_loss"][0] - val[-1]) < 0.5
    assert metrics["test_loss"][0] != val[-1]


def test_digits_few_epochs_learn(home, tmp_path):
    metrics, _ = run_trial("digits", {"epochs": 3, "batch_size": 32}, tmp_path / "ckpt", home)
    assert len(metrics["val_accuracy"]) == 3
    assert metrics["val_loss"][-1] < metrics["val_loss"][0]
    assert metrics["val_accuracy"][-1] > 0.8  # chance is 0.1
    assert len(metrics["test_accuracy"]) == 1 and metrics["test_accuracy"][0] > 0.8  # once, at the end
    assert len(metrics["test_loss"]) == 1


def unigram_entropy(block_size: int) -> float:
    """Nats per byte of the best context-free model of the validation bytes charlm scores (their empirical
    byte entropy): a model must beat it to have learned anything from context."""
    from experiments.charlm import prepare
    from experiments.charlm.train import EVAL_BYTES

    stream = b"".join(path.read_bytes() for path in sorted(prepare.ensure().glob("val-*.bin")))
    rows = min(EVAL_BYTES, len(stream)) // (block_size + 1)
    # The scored targets: each row of block_size + 1 bytes predicts all but its first byte.
    targets = b"".join(stream[i * (block_size + 1) + 1:(i + 1) * (block_size + 1)] for i in range(rows))
    counts = torch.bincount(torch.frombuffer(bytearray(targets), dtype=torch.uint8).long(), minlength=256)
    probs = counts[counts > 0].double() / len(targets)
    return float(-(probs * probs.log()).sum())


# 100 steps is about a second per trial; the swiglu variant (dropout, untied) gets 160 to clear the bar on the
# training files the holdout split leaves.
@pytest.mark.parametrize("params", [
    {"activation": "swiglu", "norm": "rmsnorm", "positions": "rope", "tied": False, "dropout": 0.1,
     "schedule": "linear", "grad_clip": 0.0, "max_steps": 160},
    # max_tokens is not a multiple of the 256 tokens per step: the budget rounds up to 100 steps
    {"activation": "relu", "positions": "rope", "heads": 3, "width": 40, "schedule": "constant",
     "max_tokens": 25_500},
])
def test_charlm_variants_train(home, tmp_path, params):
    metrics, run_params = run_trial("charlm", {**TINY_CHARLM, "max_steps": 100, **params}, tmp_path / "ckpt", home)
    unigram = unigram_entropy(TINY_CHARLM["block_size"])  # 3.1 nats on CPython 3.11's standard library
    # Below the unigram entropy means the model uses context; a loss just under ln 256 means nothing.
    assert metrics["val_loss"][-1] < unigram - 0.15, (metrics["val_loss"], unigram)
    width = int(run_params["model_width"])
    assert width % (2 * int(run_params["heads"])) == 0 and width >= int(run_params["width"])
    if params.get("max_tokens"):
        assert int(run_params["total_steps"]) == 100  # budget in tokens, rounded up to whole steps


# Each variant's budget and learning rate let it learn: 3 epochs end at 0.88-0.98 accuracy (chance is 0.1).
@pytest.mark.parametrize("params", [
    {"arch": "cnn", "norm": "batchnorm", "activation": "gelu", "optimizer": "sgd", "lr": 0.2},
    {"arch": "mlp", "norm": "layernorm", "activation": "silu", "depth": 1, "label_smoothing": 0.1,
     "schedule": "constant"},
    # 1,437 = 4 * 359 + 1: without drop_last the last batch would hold one image, and BatchNorm fails on it
    {"arch": "mlp", "norm": "batchnorm", "activation": "tanh", "hidden": 16, "batch_size": 359, "lr": 0.03},
])
def test_digits_variants_train(home, tmp_path, params):
    metrics, _ = run_trial("digits", {"epochs": 3, **params}, tmp_path / "ckpt", home)
    accuracy = metrics["val_accuracy"]
    assert accuracy[-1] > 0.7, accuracy
    assert metrics["val_loss"][-1] < metrics["val_loss"][0], metrics["val_loss"]


def test_finished_trial_rerun_reports_same_metric(home, tmp_path):
    # A job that finished but whose exit the service missed may be run again: it must not retrain.
    first, _ = run_trial("digits", {"epochs": 1}, tmp_path / "ckpt", home)
    again, _ = run_trial("digits", {"epochs": 1}, tmp_path / "ckpt", home)
    assert again["val_accuracy"] == first["val_accuracy"]
    assert "train_loss" not in again  # no training step ran the second time
