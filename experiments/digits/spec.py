"""digits: handwritten-digit classification on scikit-learn's bundled 8x8 digits, read as PNG files.

The one place that declares what a trial may change, what it is judged on and how much it may spend. Kept
import-light (no torch): `autoresearch submit --experiment digits` validates params against this space.

Budget is counted in epochs over the 1,077 training images, never in seconds. The defaults are sized for a
CPU core (seconds of CPU time once the data is prepared: benchmarks/RESULTS.md); on a GPU raise `scale` (it
multiplies width and batch size).
"""

from experiments.registry import ExperimentSpec
from experiments.space import Categorical, Float, Int, SearchSpace

SPACE = SearchSpace({
    # architecture
    "arch": Categorical(("mlp", "cnn"), default="mlp", help="a multilayer perceptron or a small convnet"),
    "hidden": Int(16, 1024, log=True, default=128, when=("arch", ("mlp",)), help="units per hidden layer"),
    "depth": Int(1, 4, default=2, when=("arch", ("mlp",)), help="hidden layers"),
    "channels": Int(4, 128, log=True, default=16, when=("arch", ("cnn",)),
                    help="channels of the first conv layer (the second has twice as many)"),
    "activation": Categorical(("relu", "gelu", "silu", "tanh"), default="relu"),
    "norm": Categorical(("none", "batchnorm", "layernorm"), default="none"),
    "dropout": Float(0.0, 0.5, default=0.1),
    # optimisation
    "optimizer": Categorical(("adamw", "sgd"), default="adamw"),
    "lr": Float(1e-4, 1.0, log=True, default=3e-3, help="peak learning rate (sgd wants ~10x adamw's)"),
    "momentum": Float(0.0, 0.99, default=0.9, when=("optimizer", ("sgd",)), help="Nesterov momentum"),
    "weight_decay": Float(0.0, 0.1, default=1e-4),
    "schedule": Categorical(("cosine", "constant"), default="cosine"),
    "label_smoothing": Float(0.0, 0.3, default=0.0),
    "batch_size": Int(8, 512, log=True, default=64),
    "seed": Int(0, 2**31 - 1, default=0),
    # budget and scale
    "epochs": Int(1, 200, default=10, help="passes over the training images"),
    "scale": Int(1, 16, log=True, default=1,
                 help="multiplies width and batch size: 1 fits 2 CPU cores, 4-16 suits one GPU"),
})

SPEC = ExperimentSpec(
    name="digits",
    description=(
        "Classify scikit-learn's 8x8 handwritten digits (1,797 images written as PNG files; 1,077 train, "
        "360 validation, 360 held out). Maximise validation accuracy. Choices: MLP or small CNN and their sizes, "
        "activation, normalisation, dropout, optimizer (AdamW or SGD with momentum), learning rate, "
        "schedule, weight decay, label smoothing, batch size, epochs, seed."
    ),
    space=SPACE,
    metric="val_accuracy",
    direction="maximize",
    entrypoint="experiments.digits.train",
    budget={"epochs": 10, "scale": 1},  # held fixed while searching
    progress_metric="val_accuracy",
    holdout_metric="test_accuracy",  # logged once at the end, on the 360 test images
    # What population-based training may change mid-run (train.py applies them after a restore or at a step of
    # a replayed schedule); the batch size is not: the loader's position counts batches.
    mutable=("lr", "weight_decay", "dropout", "label_smoothing"),
)
