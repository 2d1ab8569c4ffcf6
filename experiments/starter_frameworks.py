"""What `autoresearch init` knows of the training frameworks whose parsers it reads (`experiments.starter`).

A Hugging Face `Trainer` script (`HfArgumentParser` over `TrainingArguments`) and a `LightningCLI` script expose
dozens of options that are the framework's, not the model's (`push_to_hub`, `ddp_backend`, `trainer.plugins`):
searching them wastes trials, and their generic ranges can be wrong (`adam_beta2` above 1). A `Framework` says
which options go through the usual rules, the few of its own that are searched (with ranges that make sense),
what is added to `run` (the output folder under the job's checkpoint dir, the MLflow hook-up), the metric the
framework reports and how it prints it, and how it resumes.

- Trainer: the script's own dataclasses by the usual rules; of `TrainingArguments` only `learning_rate`,
  `weight_decay`, `warmup_steps` (a ratio of the steps: `[0, 1)` is one in transformers 5), the train batch size
  and the scheduler; `--output_dir={checkpoint_dir}`, `--report_to=mlflow` (the Trainer's MLflow callback then
  logs into the job's own run: it honours MLFLOW_RUN_ID); metric `eval_loss`. A script that calls
  `get_last_checkpoint(output_dir)` resumes by itself.
- LightningCLI: `--model.*` and `--data.*` by the usual rules (dotted names, quoted in the toml); the seed is
  `seed_everything`; `--trainer.default_root_dir={checkpoint_dir}`, an `MLFlowLogger` pointed at the job's run
  (`--trainer.logger.run_id=$MLFLOW_RUN_ID`, so its checkpoints' folder is the same in every attempt);
  `resume = "--ckpt_path=last"`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

TRAINER_METRIC_PATTERN = r"""'eval_loss': '?(?P<value>[0-9.eE+-]+)"""  # `{'eval_loss': '3.86', ...}` (4.x: unquoted)
TRAINER_SEARCHED = ("learning_rate", "weight_decay", "warmup_steps", "per_device_train_batch_size",
                    "lr_scheduler_type", "seed", "output_dir")
TRAINER_ENTRIES = {  # where the usual rules would guess wrong for the Trainer's own options
    "per_device_train_batch_size": {"type": "int", "low": 2, "high": 32, "log": True, "default": 8},
    "weight_decay": {"type": "float", "low": 0.0, "high": 0.1, "default": 0.0},
    "warmup_steps": {"type": "float", "low": 0.0, "high": 0.2, "default": 0.0},
    "lr_scheduler_type": {"type": "choice", "values": ["linear", "cosine", "constant_with_warmup"],
                          "default": "linear"},
}
MLFLOW_RUN = "$MLFLOW_RUN_ID"  # expanded by the job's shell (warm or cold) to the job's own run
MLFLOW_URI = "$MLFLOW_TRACKING_URI"


@dataclass(frozen=True)
class Framework:
    """How one framework's scripts become a starter (see the module docstring)."""

    name: str                                   # as the header names it
    metric: str
    direction: str
    pattern: str | None = None
    placed: tuple[str, ...] = ()                # words added to `run` (ours: never quoted)
    resume: str | None = None
    seed: str | None = None
    notes: tuple[str, ...] = ()                 # comment lines at the end
    entries: dict = field(default_factory=dict)  # ready [space] entries by option name
    keep: tuple[str, ...] = ()                  # option names or `prefix.` that go through the usual rules
    given: frozenset = frozenset()              # option names given on the init command line

    def keeps(self, option: dict) -> bool:
        """Whether the option is the script's own (or one of the few the framework searches)."""
        name = option["name"]
        return any(name == k or k.endswith(".") and name.startswith(k) for k in self.keep)


def detect(report: dict, source: str, given: set[str], hints: list[str]) -> Framework | None:
    """The framework that built the parser (`report["framework"]`, from the probe), or None for a plain one."""
    kind = report.get("framework") or ""
    if kind == "transformers":
        return _trainer(report, source, given)
    if kind == "lightning":
        return _lightning(report, source, given, hints)
    return None


def _trainer(report: dict, source: str, given: set[str]) -> Framework:
    ours = tuple(o["name"] for o in report["options"] if o.get("group") not in ("trainer", ""))
    notes = ["TrainingArguments: the budget (--max_steps, --num_train_epochs), evaluation (--eval_strategy "
             "steps --eval_steps N) and the rest stay as run gives them (see --help); the metric needs an "
             "evaluation: give --eval_strategy in run or call trainer.evaluate()"]
    if re.search(r"\bget_last_checkpoint\s*\(", source):
        notes.append("resume: the script resumes by itself (get_last_checkpoint(output_dir) in train())")
    else:
        notes.append("resume: pass get_last_checkpoint(training_args.output_dir) (transformers.trainer_utils) to "
                     "trainer.train(resume_from_checkpoint=...): a preempted trial then continues")
    placed = () if "--report_to" in given else ("--report_to=mlflow",)
    return Framework("Hugging Face Trainer", "eval_loss", "minimize", TRAINER_METRIC_PATTERN, placed=placed,
                     notes=tuple(notes), entries=TRAINER_ENTRIES, keep=ours + TRAINER_SEARCHED,
                     given=frozenset(given))


def _lightning(report: dict, source: str, given: set[str], hints: list[str]) -> Framework:
    names = {o["name"] for o in report["options"]}
    placed = []
    if "trainer.default_root_dir" in names and "--trainer.default_root_dir" not in given:
        placed.append("--trainer.default_root_dir={checkpoint_dir}")
    notes = ["trainer.*: the budget (--trainer.max_epochs, --trainer.max_steps) and the rest stay as the script "
             "and run give them"]
    if "trainer.logger" in names and not any(g.startswith("--trainer.logger") for g in given):
        if "MLFlowLogger" not in source:
            placed.append("--trainer.logger=MLFlowLogger")
            notes.append("MLFlowLogger with an MLflow database: LightningCLI(..., save_config_callback=None) "
                         "(its config saving needs a log folder the logger does not have)")
        placed += [f"--trainer.logger.run_id={MLFLOW_RUN}", f"--trainer.logger.tracking_uri={MLFLOW_URI}"]
    resume = "--ckpt_path=last" if "ckpt_path" in names else None
    if resume:
        notes.append("resume: --ckpt_path=last loads the newest last.ckpt: ModelCheckpoint(save_last=True)")
    metric = hints[0] if hints else "val_loss"
    maximize = re.search(r"acc|f1|auc|score|reward|bleu|precision|recall|return", metric, re.I)
    return Framework("LightningCLI", metric, "maximize" if maximize else "minimize", None, placed=tuple(placed),
                     resume=resume, seed="seed_everything" if "seed_everything" in names else None,
                     notes=tuple(notes), keep=("model.", "data."), given=frozenset(given))
