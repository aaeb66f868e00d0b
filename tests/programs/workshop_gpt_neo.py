"""A GPT-neo fine-tuning script as a LUMI AI workshop participant writes it: its own argparse,
the rank variables read from the environment, Hugging Face's TrainingArguments and Trainer in
transformers' 4.x API (`logging_dir=`, `Trainer(tokenizer=...)`, which transformers 5 removed),
and nothing of xscale's. The model and the data come from local paths (tests/fixtures/
tiny_gpt_neo.py) instead of the Hub.

tests/test_gpt_neo.py runs it unchanged through run.sh on two nodes: a script written for the
images LUMI ships must run on xscale's pins (constraints.txt). Rank 0 prints `RESULT {json}`.
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
    Trainer,
    TrainingArguments,
)


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
    trainer = Trainer(
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
