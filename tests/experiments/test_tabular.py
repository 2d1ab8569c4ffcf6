"""The tabular experiment: its table really follows the stated generative process (so the best achievable
metric is known), its exports read back, and a few epochs of real training approach that bound."""

from __future__ import annotations

import json

import numpy as np
import pytest

from experiments.tabular import prepare

ROWS = 6000


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    return prepare.ensure(ROWS, tmp_path_factory.mktemp("vol") / "tabular")


def test_the_table_follows_the_stated_process_and_the_best_metric_is_the_noise(volume):
    from deltalake import DeltaTable

    table = DeltaTable(str(volume / "delta")).to_pyarrow_table()
    assert table.num_rows == ROWS
    x = np.stack([table.column(c).to_numpy() for c in prepare.NUMERIC], axis=1).astype(np.float64)
    mu = prepare.mean(x, table.column("c0").to_numpy(), table.column("c1").to_numpy())
    residual = table.column("y").to_numpy() - mu
    assert np.allclose(residual, table.column("noise").to_numpy(), atol=1e-5), "y = mean + noise, as documented"
    facts = json.loads((volume / "MANIFEST.json").read_text())
    val = table.filter(np.array(table.column("split").to_pylist()) == "val")
    assert facts["bayes_mse"] == pytest.approx(float(np.mean(val.column("noise").to_numpy().astype(float) ** 2)))
    assert 0.2 < facts["bayes_mse"] < 0.3 and facts["train_rows"] + facts["val_rows"] + facts["test_rows"] == ROWS
    assert np.var(mu) > 1.0, "the features explain far more than the noise: there is something to learn"


def test_the_exports_hold_the_splits_without_the_answer(volume):
    from runtime.data.parquet import read_manifest

    train, val = read_manifest(str(volume / "train")), read_manifest(str(volume / "val"))
    assert train["columns"] == val["columns"] == ["id", *prepare.NUMERIC, "c0", "c1", "y"]
    assert "noise" not in train["columns"] and train["where"] == "split = 'train'"
    test = read_manifest(str(volume / "test"))
    assert test["columns"] == train["columns"] and test["where"] == "split = 'test'"
    assert train["rows"] + val["rows"] + test["rows"] == ROWS and 0.05 < test["rows"] / ROWS < 0.15


def test_preparing_again_is_a_no_op(volume):
    stamp = (volume / "MANIFEST.json").stat().st_mtime_ns
    assert prepare.ensure(ROWS, volume) == volume
    assert (volume / "MANIFEST.json").stat().st_mtime_ns == stamp


def test_a_few_epochs_learn_towards_the_bound(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from experiments import registry
    from experiments.tabular import train
    from runtime.context import ContextConfig, JobContext

    monkeypatch.setenv("AUTORESEARCH_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("AUTORESEARCH_VOLUMES", raising=False)
    spec = registry.get("tabular")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    ctx = JobContext(job_id=None, attempt=0, params={}, checkpoint_dir=tmp_path / "ckpt", tracking_uri=uri,
                     config=ContextConfig(handle_signals=False))
    try:
        train.train(ctx, spec.validate({"rows": 20000, "epochs": 3, "batch_size": 128}))
    finally:
        ctx.close()
    client = MlflowClient(tracking_uri=uri)
    val = [m.value for m in sorted(client.get_metric_history(ctx.run_id, "val_mse"), key=lambda m: m.step)]
    excess = client.get_run(ctx.run_id).data.metrics["val_excess"]
    assert len(val) == 3 and val[-1] < val[0]
    assert val[-1] < 0.7, "well below the target's variance (about 2)"
    assert excess == pytest.approx(val[-1] - float(client.get_run(ctx.run_id).data.params["bayes_mse"]))
    assert excess > 0, "no model beats the noise"
    test = client.get_metric_history(ctx.run_id, "test_mse")
    assert len(test) == 1 and 0.25 < test[0].value < 0.7  # the holdout: scored once, at the end, near val
