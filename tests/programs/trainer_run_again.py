"""The real XscaleTrainer alone on the CPU, trained to its last step (max_steps=2, which it
saves), then built and trained again over the same output directory, as a finished job submitted
again does: prints, as JSON, each call's global step and whether the second changed the weights.

tests/test_gpt_neo.py (test_a_trainer_run_again_after_its_last_step_trains_no_step_more) runs
it with the output directory as its argument.
"""

import json
import sys

import torch
from torch import nn
from transformers import TrainingArguments
from xscale.hf import XscaleTrainer


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": ((self.linear(x).squeeze(-1) - labels) ** 2).mean()}


def train(output_dir: str) -> tuple[int, torch.Tensor]:
    torch.manual_seed(0)
    samples = [{"x": torch.randn(4), "labels": torch.randn(())} for _ in range(64)]
    args = TrainingArguments(output_dir=output_dir, max_steps=2, per_device_train_batch_size=4,
                             learning_rate=0.1, lr_scheduler_type="constant", report_to=[],
                             use_cpu=True)
    trainer = XscaleTrainer(model=Regression(), args=args, train_dataset=samples)
    trainer.train()
    return trainer.state.global_step, trainer.model.linear.weight.detach().clone()


first_step, first = train(sys.argv[1])
again_step, again = train(sys.argv[1])
print("RESULT " + json.dumps({"steps": [first_step, again_step],
                              "weights_changed": not torch.equal(first, again)}), flush=True)
