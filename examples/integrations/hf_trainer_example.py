"""stabletrain in the Hugging Face Trainer: nancapture with replay from the model's config.

A tiny GPT-2 with random weights (nothing is downloaded) whose input embedding of token 63
holds +-1e30: finite weights, but the first LayerNorm that sees it squares 1e30 past
float32's range. Only sample 29 holds token 63; with batch size 4 and 2 accumulation steps,
in order, that is step 3, micro step 1, row 1. The callback stops training there, before
clipping and the optimizer step, and the capture replays with the model rebuilt from its
class and config.

    python examples/integrations/hf_trainer_example.py out/hf_trainer
"""

from __future__ import annotations

import sys

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from stabletrain import NaNDetectedError, load_nan_capture
from stabletrain.integrations.transformers import StabletrainCallback


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, bad: int = 29):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, 63, (n, 16), generator=g)
        self.ids[bad, 5] = 63

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(out: str) -> int:
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2, tie_word_embeddings=False,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        model.transformer.wte.weight[63] = torch.tensor([1e30, -1e30]).repeat(16)
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=8, logging_steps=1,
        learning_rate=1e-3, max_grad_norm=1.0, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
        train_sampling_strategy="sequential",
    )
    callback = StabletrainCallback(debug_args={"nancapture": {"enabled": True}})
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback])
    try:
        trainer.train()
    except NaNDetectedError as err:
        print("grad_norm logged by the Trainer:", [round(r["grad_norm"], 4) for r in trainer.state.log_history])
        print("gradient_norm of the callback:  ", [round(v, 4) for v in callback.gradient_norms.values()])
        print(f"\nNaNDetectedError: {err}\n")
        print(load_nan_capture(err.capture_path).replay())  # the model is rebuilt from its class and config
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "out/hf_trainer"))
