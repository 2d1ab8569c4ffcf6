"""charlm: a small GPT-style byte-level language model on Python's standard library source.

The one place that declares what a trial may change, what it is judged on and how much it may spend. Kept
import-light (no torch): `autoresearch submit --experiment charlm` validates params against this space.

Budget is counted in optimizer steps (or tokens, when `max_tokens` is set), never in seconds, so a trial's
result does not depend on how busy the machine was. The defaults finish in well under a minute on 2 CPU
cores; on a GPU raise `scale` (it multiplies width and batch size) and `max_steps`.
"""

from experiments.registry import ExperimentSpec
from experiments.space import Categorical, Float, Int, SearchSpace

SPACE = SearchSpace({
    # architecture
    "layers": Int(1, 16, default=2, help="transformer blocks"),
    "heads": Int(1, 16, default=4, help="attention heads per block"),
    "width": Int(32, 2048, log=True, default=128,
                 help="residual stream width; rounded up to a multiple of 2*heads"),
    "mlp_ratio": Int(1, 8, default=4, help="MLP hidden size / width (swiglu uses 2/3 of it, as LLaMA does)"),
    "activation": Categorical(("gelu", "relu", "swiglu"), default="gelu"),
    "norm": Categorical(("layernorm", "rmsnorm"), default="layernorm"),
    "positions": Categorical(("learned", "rope"), default="learned"),
    "dropout": Float(0.0, 0.5, default=0.0),
    "tied": Categorical((True, False), default=True, help="share the input embedding and the output head"),
    "block_size": Int(16, 2048, log=True, default=64, help="context length in bytes"),
    # optimisation
    "lr": Float(1e-4, 3e-2, log=True, default=3e-3, help="peak AdamW learning rate"),
    "warmup": Float(0.0, 0.5, default=0.05, help="linear warmup, as a fraction of the step budget"),
    "schedule": Categorical(("cosine", "linear", "constant"), default="cosine",
                            help="decay after warmup, down to lr/10"),
    "weight_decay": Float(0.0, 0.5, default=0.1, help="AdamW decoupled weight decay on matrices only"),
    "beta1": Float(0.5, 0.99, default=0.9),
    "beta2": Float(0.9, 0.9999, default=0.99),
    "batch_size": Int(1, 512, log=True, default=16, help="sequences per step"),
    "grad_clip": Float(0.0, 10.0, default=1.0, help="max global grad norm; 0 turns clipping off"),
    "seed": Int(0, 2**31 - 1, default=0),
    # budget and scale
    "max_steps": Int(1, 1_000_000, log=True, default=300, help="optimizer steps per trial"),
    "max_tokens": Int(0, 10**12, default=0,
                      help="if > 0, the budget in training tokens instead (overrides max_steps)"),
    "scale": Int(1, 64, log=True, default=1,
                 help="multiplies width and batch size: 1 fits 2 CPU cores, 8-32 suits one GPU"),
    # where the corpus is read from
    "data": Categorical(("files", "shards"), default="files",
                        help="the corpus's small files, or tar shards packed from them: bitwise the same run"),
})

SPEC = ExperimentSpec(
    name="charlm",
    description=(
        "Byte-level GPT on Python standard-library source (built locally, no network). Minimise validation "
        "loss in nats per byte (bits per byte = val_loss / ln 2). Architecture choices: layers, heads, "
        "width, MLP ratio and activation, norm, positions, dropout, tied embeddings; training choices: lr, "
        "warmup, schedule, weight decay, betas, batch size, gradient clipping, seed."
    ),
    space=SPACE,
    metric="val_loss",
    direction="minimize",
    entrypoint="experiments.charlm.train",
    budget={"max_steps": 300, "max_tokens": 0, "scale": 1, "data": "files"},  # held fixed while searching
    progress_metric="val_loss",
    holdout_metric="test_loss",  # logged once at the end, on files no other split holds
    # What population-based training may change mid-run (train.py applies them after a restore or at a step of
    # a replayed schedule).
    mutable=("lr", "weight_decay", "dropout", "grad_clip"),
)
