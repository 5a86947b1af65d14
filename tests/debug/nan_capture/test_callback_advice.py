"""The trainer's NaN stop names where to continue: an asynchronous checkpoint still being written is
committed before the advice is written (under load the message once named the checkpoint before it and
said last.ckpt held it, false once the commit landed: tests/distributed/test_fsdp_sharded.py)."""

from __future__ import annotations

from types import SimpleNamespace

from stabletrain.debug.nan_capture.callback import NaNCaptureCallback


class Trainer:
    """What the callback's advice reads of the trainer, recording the order of the calls."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.calls: list[str] = []
        self.fabric = SimpleNamespace(barrier=lambda: self.calls.append("barrier"))

    def settle_checkpoints(self) -> None:
        self.calls.append("settle")

    def resume_advice(self, step: int, **kwargs) -> str:
        self.calls.append("advice")
        return f"Continue from the newest healthy checkpoint before step {step}."


def test_the_advice_is_written_after_the_checkpoints_settle():
    for world_size, expected in ((1, ["settle", "advice"]), (2, ["settle", "barrier", "advice"])):
        trainer = Trainer(world_size)
        text = NaNCaptureCallback(args=None)._advice(trainer, 7)
        assert trainer.calls == expected
        assert text == ("No non-finite value reached the optimizer or a checkpoint. Continue from the newest healthy "
                        "checkpoint before step 7.")
