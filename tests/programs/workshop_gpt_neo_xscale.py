"""workshop_gpt_neo.py with xscale: the same script plus the lines docs/YOUR-SCRIPT.md shows for
a Hugging Face Trainer script (tests/test_own_scripts.py checks that they are the only
difference). For them it stops and saves at Slurm's warning, resumes where it stopped, names a
straggler, writes the summary and notes its progress for the goodput ledger.
"""

import argparse
import json
import math
import os

import torch
from datasets import load_from_disk
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    TrainingArguments,
)
from xscale.hf import XscaleTrainer


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-name", default="gpt-imdb-model")
    parser.add_argument("--output-path", required=True)
    parser.add_argument("--logging-path", required=True)
    parser.add_argument("--num-workers", type=int, default=1)
    parser.add_argument("--pretrained-model", required=True)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--max-steps", type=int, default=20)
    args, _ = parser.parse_known_args()
    return args


def main() -> None:
    args = parse_args()
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    output_dir = os.path.join(args.output_path, args.model_name)
    logging_dir = os.path.join(args.logging_path, args.model_name)

    tokenizer = AutoTokenizer.from_pretrained(args.pretrained_model, use_fast=True)
    tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.pretrained_model)
    reviews = load_from_disk(args.dataset)

    training_args = TrainingArguments(
        output_dir=output_dir,
        save_strategy="steps",
        save_steps=10,
        save_total_limit=2,
        logging_dir=logging_dir,
        logging_steps=5,
        eval_strategy="steps",
        eval_steps=10,
        learning_rate=1e-3,
        weight_decay=0.01,
        per_device_train_batch_size=16 // world_size,
        per_device_eval_batch_size=32,
        max_steps=args.max_steps,
        dataloader_num_workers=args.num_workers,
        report_to=["tensorboard"],
        ddp_find_unused_parameters=False,
    )

    def tokenize(batch: dict) -> dict:
        texts = [text + tokenizer.eos_token for text in batch["text"]]
        return tokenizer(texts, max_length=64, truncation=True)

    columns = reviews["train"].column_names
    train = reviews["train"].map(tokenize, batched=True, remove_columns=columns)
    test = reviews["test"].map(tokenize, batched=True, remove_columns=columns)
    trainer = XscaleTrainer(
        model=model,
        args=training_args,
        tokenizer=tokenizer,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        train_dataset=train,
        eval_dataset=test,
    )
    trainer.train()
    eval_loss = trainer.evaluate()["eval_loss"]
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    if rank == 0:
        print(f"Perplexity on test: {math.exp(eval_loss):.2f}")
        print("RESULT " + json.dumps({"world_size": world_size, "steps": trainer.state.global_step,
                                      "losses": losses, "logging_dir": logging_dir,
                                      "process_group": torch.distributed.is_initialized()}),
              flush=True)


if __name__ == "__main__":
    main()
