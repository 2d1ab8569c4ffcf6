"""tabular: regression on a synthetic table with numeric and categorical features whose generative process
is known, so the best achievable validation error is known too (the noise variance, 0.25).

The one place that declares what a trial may change, what it is judged on and how much it may spend. Kept
import-light (no torch): `autoresearch submit --experiment tabular` validates params against this space.

Budget is counted in epochs over `rows` rows (70% train), never in seconds. The defaults (100,000 rows,
4 epochs) take a few seconds of one CPU core once the data is prepared; on a GPU raise `rows` into the
millions and `scale` (it multiplies width and batch size).
"""

from experiments.registry import ExperimentSpec
from experiments.space import Categorical, Float, Int, SearchSpace

SPACE = SearchSpace({
    # architecture: embeddings of the two categorical columns, concatenated with the numeric ones, into an MLP
    "hidden": Int(8, 1024, log=True, default=64, help="units per hidden layer"),
    "depth": Int(1, 4, default=2, help="hidden layers"),
    "emb_dim": Int(1, 32, log=True, default=4, help="embedding size of each categorical feature"),
    "activation": Categorical(("relu", "gelu", "silu", "tanh"), default="relu"),
    "dropout": Float(0.0, 0.5, default=0.0),
    # optimisation
    "lr": Float(1e-4, 3e-2, log=True, default=3e-3, help="peak AdamW learning rate"),
    "weight_decay": Float(0.0, 0.1, default=0.0),
    "schedule": Categorical(("cosine", "constant"), default="cosine"),
    "batch_size": Int(32, 8192, log=True, default=512, help="rows per step (per rank)"),
    "seed": Int(0, 2**31 - 1, default=0),
    # budget and scale
    "epochs": Int(1, 100, default=4, help="passes over the training rows"),
    "rows": Int(1000, 100_000_000, log=True, default=100_000,
                help="rows in the generated table (70% train, 20% validation, 10% test); each size is prepared once"),
    "scale": Int(1, 16, log=True, default=1,
                 help="multiplies width and batch size: 1 fits 2 CPU cores, 4-16 suits one GPU"),
})

SPEC = ExperimentSpec(
    name="tabular",
    description=(
        "Regression on a synthetic table (6 numeric features, 2 categorical features of 12 and 6 levels, "
        "interactions and non-linearities, Gaussian noise of variance 0.25), stored as a Delta table and read "
        "as Parquet. Minimise validation mean squared error; 0.25 is the best any model can reach "
        "(val_excess = val_mse minus the noise on the validation rows). Choices: MLP width and depth, "
        "embedding size, activation, dropout, AdamW learning rate and weight decay, schedule, batch size, "
        "epochs, seed."
    ),
    space=SPACE,
    metric="val_mse",
    direction="minimize",
    entrypoint="experiments.tabular.train",
    budget={"epochs": 4, "rows": 100_000, "scale": 1},  # held fixed while searching
    progress_metric="val_mse",
    holdout_metric="test_mse",  # logged once at the end, on the 10% test rows
)
