"""XscaleTrainer alone on the CPU over a data set whose samples draw noise (an augmentation) from
torch's and Python's generators: trained 8 steps (two epochs) with two DataLoader workers, then
again from the step-3 checkpoint with none, once with XscaleTrainer and once with Trainer.
Prints, as JSON, for each trainer whether the resumed run's samples drew what the first run's
did at the same steps and whether its weights are the same, and whether a sample drew anew in
the second epoch; then which data sets XscaleTrainer seeds sample by sample (a Hugging Face
data set read as stored draws nothing and keeps its batched reads).

tests/test_gpt_neo.py (test_trainers_samples_draw_the_same_after_a_resume_with_any_workers)
runs it with a directory to train in as its argument.
"""

import json
import random
import shutil
import sys
from pathlib import Path

import datasets
import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments
from xscale.data import SeededSamples
from xscale.hf import XscaleTrainer

SAMPLES, BATCH, STEPS = 16, 4, 8


class NoisySamples(Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, 4, generator=generator)
        self.y = torch.randn(SAMPLES, generator=generator)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        noise = torch.randn(4) * 0.1 + random.random()
        return {"x": self.x[index] + noise, "labels": self.y[index],
                "index": torch.tensor(index), "noise": noise}


class Regression(nn.Module):
    """Records, in the main process, the noise each sample of each step drew."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)
        self.drawn: list[tuple[int, list[int], list[list[float]]]] = []

    def forward(self, x, labels, index, noise):
        if self.training:
            self.drawn.append((len(self.drawn), index.tolist(), noise.tolist()))
        return {"loss": ((self.linear(x).squeeze(-1) - labels) ** 2).mean()}


def train(kind: type[Trainer], output_dir: Path, workers: int, first_step: int):
    torch.manual_seed(0)
    args = TrainingArguments(output_dir=str(output_dir), max_steps=STEPS, save_steps=3,
                             per_device_train_batch_size=BATCH, learning_rate=0.1,
                             lr_scheduler_type="constant", report_to=[], use_cpu=True,
                             dataloader_num_workers=workers, remove_unused_columns=False)
    model = Regression()
    trainer = kind(model=model, args=args, train_dataset=NoisySamples())
    checkpoint = output_dir / "checkpoint-3"
    trainer.train(resume_from_checkpoint=str(checkpoint) if first_step else None)
    drawn = {first_step + step: (indices, noise) for step, indices, noise in model.drawn}
    return drawn, model.linear.weight.detach().clone()


def compare(kind: type[Trainer], root: Path) -> dict[str, bool]:
    first, resumed = root / kind.__name__ / "first", root / kind.__name__ / "resumed"
    drawn, weights = train(kind, first, workers=2, first_step=0)
    shutil.copytree(first / "checkpoint-3", resumed / "checkpoint-3")
    drawn_again, weights_again = train(kind, resumed, workers=0, first_step=3)
    resumed_steps = sorted(drawn_again)
    anew = {}
    for step in sorted(drawn):  # each index's noise, epoch by epoch
        for index, noise in zip(*drawn[step], strict=True):
            anew.setdefault(index, []).append(noise)
    return {"resumed_steps": resumed_steps,
            "same_draws": all(drawn_again[step] == drawn[step] for step in resumed_steps),
            "same_weights": torch.equal(weights, weights_again),
            "anew_each_epoch": all(len(draws) == 2 and draws[0] != draws[1]
                                   for draws in anew.values())}


def seeded(dataset: Dataset, output_dir: Path) -> bool:
    """Whether XscaleTrainer's loader gives each of DATASET's samples a seed of its own."""
    args = TrainingArguments(output_dir=str(output_dir), max_steps=1, report_to=[],
                             use_cpu=True, remove_unused_columns=False)
    trainer = XscaleTrainer(model=Regression(), args=args, train_dataset=dataset)
    return isinstance(trainer.get_train_dataloader().dataset, SeededSamples)


root = Path(sys.argv[1])
result = {kind.__name__: compare(kind, root) for kind in (XscaleTrainer, Trainer)}
stored = datasets.Dataset.from_dict({"x": NoisySamples().x.tolist()})
result["seeded"] = {"torch": seeded(NoisySamples(), root / "torch"),
                    "hf_stored": seeded(stored.with_format("torch"), root / "stored"),
                    "hf_transformed": seeded(stored.with_transform(lambda rows: rows),
                                             root / "transformed")}
print("RESULT " + json.dumps(result), flush=True)
