"""Runs with faults planted at known steps, for the self-healing tests (``on_instability``).

Importable by the tests; run as a script (``python heal_faults.py OUT POLICY [ddp|fsdp]``) it trains the
same run with DDP (default) or FSDP2 on 2 CPU processes.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "debug"))

from nan_models import PoisonData, PoisonNet, samples_of_step  # noqa: E402

N = 512
NAN_STEP, SPIKE_STEP = 25, 32


def planted(world_size: int = 1) -> tuple[list[int], list[int]]:
    """All samples of the NaN step and of the spike step (every rank's, in rank order)."""
    def step(s: int) -> list[int]:
        return [i for r in range(world_size) for i in samples_of_step(s, n=N, world_size=world_size, rank=r)]
    return step(NAN_STEP), step(SPIKE_STEP)


def faulty_data(world_size: int = 1) -> PoisonData:
    """A NaN input in one sample of step 25 and a target of 1e4 (a loss spike) in one of step 32."""
    nan_samples, spike_samples = planted(world_size)
    data = PoisonData(n=N, input_poison={nan_samples[-1]: float("nan")})
    data.y[spike_samples[-1]] = 1e4
    return data


def settings(out, policy: str, **more):
    return dict(
        out=out, model=PoisonNet(), data=faulty_data(more.pop("world_size", 1)), steps=40, batch_size=8,
        num_workers=0, log_every_num_steps=1, checkpoint_every_num_steps=10,
        model_args={"lr": 0.01, "warmup_steps": 0}, trend_alerts={"enabled": False},
        on_instability={"policy": policy, "warmup": 10, "rollback_steps": 10}, **more,
    )


if __name__ == "__main__":
    import torch

    import stabletrain

    out, policy = sys.argv[1], sys.argv[2]
    strategy = sys.argv[3] if len(sys.argv) > 3 else "ddp"
    torch.manual_seed(0)  # PoisonNet's weights: the same in every run of this script (DDP and FSDP2 compared)
    stabletrain.train(**settings(out, policy, world_size=2, devices=2, strategy=strategy, accelerator="cpu"))
