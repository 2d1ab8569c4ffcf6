"""The bookkeeping a training loop does after each optimizer step, written once: count the loss, save a checkpoint
on its interval, beat the heartbeat, and on a stop request (preemption, cancel) save now and exit so the job goes
back in line. The loop itself stays the user's.

    steps = Steps(ctx, ckpt, state, name="digits")
    step = ckpt.load_latest(state) or 0
    while step < total:
        loss = train_step(batch)
        step += 1
        steps.done(step, loss)            # count, save on the interval, heartbeat, stop if asked
        if step % 100 == 0:
            ctx.log_metrics({"train_loss": steps.train_loss()}, step)
    steps.finish(total)                   # the final checkpoint; leaving `with ctx` marks the attempt complete

The running loss sums live in `counters` (a dict saved with the loader's position, as `TrainState`'s loader
carries them), so a resumed attempt reports exactly the train loss an uninterrupted one would.
"""

from __future__ import annotations

from typing import Any, Callable, Optional


class Steps:
    """After-step bookkeeping for one attempt: `ctx` a `JobContext`, `ckpt` a `CheckpointManager`, `state` the
    `TrainState` it saves, `counters` the dict that holds `loss_sum` and `loss_steps` (created when missing)."""

    def __init__(self, ctx: Any, ckpt: Any, state: Any, *, counters: Optional[dict] = None, name: str = "job",
                 say: Optional[Callable[..., Any]] = None):
        self.ctx, self.ckpt, self.state, self.name = ctx, ckpt, state, name
        self.counters = counters if counters is not None else {}
        self.counters.setdefault("loss_sum", 0.0)
        self.counters.setdefault("loss_steps", 0)
        self.say = say or (print if getattr(ctx, "is_main", True) else (lambda *a, **k: None))

    def count(self, step: int, loss: Any = None) -> None:
        """Record that `step` is done (and its loss, a tensor or a number, in the running train loss)."""
        self.state.step = step
        if loss is not None:
            self.counters["loss_sum"] += loss.item() if hasattr(loss, "item") else float(loss)
            self.counters["loss_steps"] += 1

    def checkpoint(self, step: int) -> None:
        """Save on the interval, beat the heartbeat, and on a stop request save now and exit preempted (the
        same step on every rank)."""
        self.ckpt.maybe_save(step, self.state)
        self.ctx.heartbeat(step)
        if self.ctx.should_stop():
            self.ckpt.save_now(step, self.state)
            self.say(f"{self.name}: stopped on request at step {step}; checkpoint saved", flush=True)
            self.ckpt.close()
            self.ctx.exit_preempted()

    def done(self, step: int, loss: Any = None) -> None:
        """`count` then `checkpoint`: what follows `optimizer.step()` in most loops."""
        self.count(step, loss)
        self.checkpoint(step)

    def train_loss(self) -> float:
        """The mean train loss since the last call (then the sums start again)."""
        mean = self.counters["loss_sum"] / max(1, self.counters["loss_steps"])
        self.counters.update(loss_sum=0.0, loss_steps=0)
        return mean

    def finish(self, step: int) -> None:
        """The final checkpoint (a re-run of a finished trial is then a cheap no-op), waited for."""
        self.ckpt.save_now(step, self.state)
        self.ckpt.close()
