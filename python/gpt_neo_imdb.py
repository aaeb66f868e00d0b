"""Fine-tune GPT-neo on IMDB movie reviews (causal language modelling) with Hugging Face's Trainer.

The LUMI AI workshop's GPT-neo-IMDB-finetuning.py, same command line and defaults, made to run
unchanged from one process to many nodes: start it through runscripts/run.sh (or torchrun) and
Trainer builds DDP from RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT.

    srun ... singularity exec ... /runscripts/run.sh python -u gpt_neo_imdb.py \\
        --model-name gpt-imdb-model --output-path /workdir/train-output \\
        --logging-path /workdir/train-logging --num-workers 7

Nothing is downloaded: the model and the dataset come from local directories or the Hugging Face
cache (HF_HOME), which a login node fills beforehand.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import threading
from pathlib import Path

# Compute nodes have no internet, and a thousand ranks asking the Hub at once would be throttled
# anyway: read models and data from the cache only. The Hub libraries read this when imported,
# hence before the imports below; a user who exports HF_HUB_OFFLINE=0 still gets downloads.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import datasets  # noqa: E402
import huggingface_hub  # noqa: E402
import torch  # noqa: E402
import tqdm  # noqa: E402
import transformers  # noqa: E402
import xscale  # noqa: E402
from transformers import (  # noqa: E402
    MODEL_FOR_CAUSAL_LM_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    PreTrainedTokenizerBase,
    TrainingArguments,
)
from xscale import UserError, hf  # noqa: E402

TRAINER = "gpt_neo_imdb"
PROG = "gpt_neo_imdb.py"
DEFAULT_MODEL = "EleutherAI/gpt-neo-1.3B"
DEFAULT_DATASET = "imdb"
DATA_FILE_TYPES = {".txt": "text", ".csv": "csv", ".json": "json", ".jsonl": "json",
                   ".parquet": "parquet"}
# attn_implementation values of Hugging Face's models, and auto (attention_implementation)
ATTENTION = ("auto", "eager", "sdpa", "flash_attention_2")
PROMPT = "The movie 'How to run ML on LUMI - A documentation' was great because"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Fine-tune GPT-neo on IMDB reviews with Hugging Face's Trainer (the LUMI "
                    "workshop's GPT-neo-IMDB-finetuning.py, on 1 to N GPUs or on CPU).",
    )
    parser.add_argument("--model-name", default="gpt-imdb-model",
                        help="name of this run: checkpoints go to OUTPUT_PATH/MODEL_NAME and "
                             "TensorBoard logs to LOGGING_PATH/MODEL_NAME (default %(default)s)")
    parser.add_argument("--output-path", "--output-dir", dest="output_path",
                        default="train-output",
                        help="root of the checkpoints (default %(default)s)")
    parser.add_argument("--logging-path", default="train-logging",
                        help="root of the TensorBoard logs, written by rank 0 "
                             "(default %(default)s)")
    parser.add_argument("--num-workers", type=int, default=1,
                        help="CPU worker processes per rank, for tokenizing and data loading "
                             "(default %(default)s; the workshop uses 7 per GCD on LUMI)")
    parser.add_argument("--resume", action=argparse.BooleanOptionalAction, default=None,
                        help="continue from the newest checkpoint in OUTPUT_PATH/MODEL_NAME; "
                             "automatic when one exists (so a requeued job resumes); "
                             "--no-resume starts again from the base model")
    parser.add_argument("--pretrained-model", default=DEFAULT_MODEL,
                        help="base model: a local directory or a name in the Hugging Face cache "
                             "(default %(default)s)")
    parser.add_argument("--dataset", default=DEFAULT_DATASET,
                        help="a `datasets` save_to_disk directory, a directory with train.* and "
                             "test.* files (txt/csv/json/jsonl/parquet, a `text` column), or a "
                             "dataset name in the Hugging Face cache (default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=32,
                        help="training batch size per device (default %(default)s, about what fits "
                             "a 64 GB MI250x GCD in bf16; the scaling exercise lowers it to 24)")
    parser.add_argument("--eval-batch-size", type=int, default=128,
                        help="evaluation batch size per device (default %(default)s)")
    parser.add_argument("--max-steps", type=int, default=1000,
                        help="optimizer steps in total, counting those before a resume "
                             "(default %(default)s)")
    parser.add_argument("--max-length", type=int, default=256,
                        help="tokens per training sequence; longer reviews are cut into several "
                             "(default %(default)s)")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1, metavar="N",
                        help="micro-batches of --batch-size per optimizer step "
                             "(default %(default)s)")
    parser.add_argument("--learning-rate", type=float, default=2e-5,
                        help="AdamW learning rate (default %(default)s)")
    parser.add_argument("--save-steps", type=xscale.checkpoint_interval, default=100,
                        metavar="N|auto",
                        help="checkpoint every N steps, keeping the last 4; auto: Young's "
                             "interval from the first save's cost and the job's size "
                             "(docs/CHECKPOINTS.md) (default %(default)s)")
    parser.add_argument("--eval-steps", type=int, default=200,
                        help="validation loss every N steps (default %(default)s)")
    parser.add_argument("--logging-steps", type=int, default=50,
                        help="log the training loss every N steps (default %(default)s)")
    parser.add_argument("--attention", choices=ATTENTION, default="auto",
                        help="how the model computes attention: auto takes flash attention "
                             "where the flash_attn package and a CUDA GPU are there and the "
                             "model supports it, else Hugging Face's default for the model "
                             "(SDPA where it has it, else eager) (default %(default)s)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the model (Trainer's torch_compile)")
    parser.add_argument("--sample-reviews", type=int, default=4,
                        help="reviews rank 0 generates from the fine-tuned model at the end "
                             "(default %(default)s)")
    # torch.distributed.launch passes --local-rank; LOCAL_RANK from the environment is what counts.
    parser.add_argument("--local-rank", "--local_rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("num_workers", "batch_size", "eval_batch_size", "max_steps", "max_length",
                 "eval_steps", "logging_steps", "sample_reviews",
                 "gradient_accumulation_steps"):
        value = getattr(args, name)
        if value < 0 or (value == 0 and name not in ("num_workers", "sample_reviews")):
            parser.error(f"--{name.replace('_', '-')} must be {'>= 0' if value < 0 else '> 0'}, "
                         f"not {value}")
    if args.save_steps == 0:
        parser.error("--save-steps must be > 0 or auto, not 0")
    return args


def resolve_model(name: str) -> str:
    """A local directory as is; otherwise the model's snapshot directory in the HF cache."""
    if Path(name).is_dir():
        return name
    try:
        cached = huggingface_hub.try_to_load_from_cache(name, "config.json")
    except huggingface_hub.errors.HFValidationError:  # a path, or no valid model name
        raise UserError(f"--pretrained-model '{name}': no such directory") from None
    if isinstance(cached, str):
        return os.path.dirname(cached)
    raise UserError(
        f"--pretrained-model '{name}' is neither a directory nor in the Hugging Face cache "
        f"({huggingface_hub.constants.HF_HUB_CACHE}); on a login node: hf download {name}"
    )


def load_reviews(spec: str) -> datasets.DatasetDict:
    """The dataset's train and test splits, in memory.

    In memory because the tokenized copies then stay in memory too: with files, every rank would
    write the same `map` cache files next to the data, which races and loads Lustre's metadata
    servers at scale.
    """
    path = Path(spec)
    if path.is_dir() and (path / "dataset_dict.json").is_file():
        splits = datasets.load_from_disk(str(path), keep_in_memory=True)
    elif path.is_dir():
        files = {f.stem: str(f) for f in sorted(path.iterdir())
                 if f.stem in ("train", "test", "unsupervised") and f.suffix in DATA_FILE_TYPES}
        if "train" not in files or "test" not in files:
            raise UserError(f"--dataset '{spec}' has no dataset_dict.json and no train.* and "
                            f"test.* files ({', '.join(DATA_FILE_TYPES)})")
        builder = DATA_FILE_TYPES[Path(files["train"]).suffix]
        splits = datasets.load_dataset(builder, data_files=files, keep_in_memory=True)
    else:
        try:
            splits = datasets.load_dataset(spec, keep_in_memory=True)
        except (ConnectionError, FileNotFoundError, ValueError) as error:
            raise UserError(
                f"--dataset '{spec}' is neither a directory nor in the Hugging Face cache "
                f"({datasets.config.HF_DATASETS_CACHE}); on a login node: "
                f"python -c \"import datasets; datasets.load_dataset('{spec}')\""
            ) from error
    if "train" not in splits or "test" not in splits or "text" not in splits["train"].column_names:
        raise UserError(f"--dataset '{spec}' needs train and test splits with a 'text' column, "
                        f"has {dict(splits.column_names)}")
    # IMDB's 50,000 unlabelled reviews are training text too for a language model.
    if "unsupervised" in splits:
        splits["train"] = datasets.concatenate_datasets([splits["train"], splits["unsupervised"]])
    return datasets.DatasetDict(train=splits["train"], test=splits["test"])


def tokenize(
    splits: datasets.DatasetDict, tokenizer: PreTrainedTokenizerBase, max_length: int,
    num_workers: int,
) -> tuple[datasets.Dataset, datasets.Dataset, datasets.Dataset]:
    """(train, validation, test) as token ids; a review longer than max_length becomes several
    sequences (return_overflowing_tokens), each review ends in EOS so the model learns to stop."""

    def encode(batch: dict[str, list]) -> dict[str, list]:
        texts = [text + tokenizer.eos_token for text in batch["text"]]
        return tokenizer(texts, max_length=max_length, truncation=True,
                         return_overflowing_tokens=True)

    def encoded(split: datasets.Dataset) -> datasets.Dataset:
        return split.map(encode, batched=True, remove_columns=split.column_names,
                         num_proc=num_workers if num_workers > 1 else None, keep_in_memory=True)

    train = encoded(splits["train"])
    # Validation during training on a small held-out slice, as the workshop does: the full
    # test set is evaluated once, at the end.
    held_out = min(1000, max(1, len(train) // 10))
    parts = train.train_test_split(test_size=held_out, seed=42, keep_in_memory=True)
    return parts["train"], parts["test"], encoded(splits["test"])


def training_arguments(args: argparse.Namespace, output_dir: str) -> TrainingArguments:
    ddp = hf.ddp_arguments()  # use_cpu, ddp_backend, ddp_timeout: xscale's choices
    on_gpu = not ddp["use_cpu"]
    return TrainingArguments(
        output_dir=output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.eval_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate,
        weight_decay=0.01,
        save_strategy="steps",
        # auto: XscaleTrainer decides (checkpoint_every), from the run's first timed save
        save_steps=args.max_steps if args.save_steps == "auto" else args.save_steps,
        save_total_limit=4,
        eval_strategy="steps",
        eval_steps=args.eval_steps,
        logging_steps=args.logging_steps,
        logging_first_step=True,  # the log's first loss is the one before any learning
        report_to=[],  # TensorBoard is added as a callback, into --logging-path
        dataloader_num_workers=args.num_workers,
        # Workers must not be forks of this process (see __main__): keep them alive.
        dataloader_persistent_workers=args.num_workers > 0,
        dataloader_pin_memory=on_gpu,
        bf16=on_gpu and torch.get_device_module(
            torch.accelerator.current_accelerator()).is_bf16_supported(),
        ddp_find_unused_parameters=False,  # every GPT-neo weight gets a gradient each step
        torch_compile=args.compile,
        **ddp,
    )


def attention_implementation(choice: str, model_class: type) -> str | None:
    """The attn_implementation to load the model with: CHOICE, or for auto flash attention
    where it can run (None: Hugging Face's own default for the model)."""
    if choice != "auto":
        return choice
    can_flash = (torch.cuda.is_available() and torch.version.cuda is not None
                 and importlib.util.find_spec("flash_attn") is not None)
    return "flash_attention_2" if can_flash and model_class._supports_flash_attn else None


def load_model(path: str, attention: str) -> torch.nn.Module:
    """The model with the attention asked for; one that it does not support is a UserError."""
    config = AutoConfig.from_pretrained(path)
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    implementation = attention_implementation(attention, model_class)
    try:
        return AutoModelForCausalLM.from_pretrained(path, attn_implementation=implementation)
    except (ValueError, ImportError) as error:  # how transformers refuses an implementation
        if implementation is None:
            raise
        reason = str(error).strip().splitlines()[0]
        raise UserError(f"--attention {attention}: {reason}") from None


def sample_reviews(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, count: int) -> None:
    inputs = tokenizer(PROMPT, return_tensors="pt").to(model.device)
    with torch.no_grad():
        outputs = model.generate(**inputs, do_sample=True, max_length=80,
                                 num_return_sequences=count)
    print("Sample generated reviews:")
    for text in tokenizer.batch_decode(outputs, skip_special_tokens=True):
        print("-", text)


def train(args: argparse.Namespace) -> int:
    # Now, not once the Trainer exists: Slurm's SIGUSR1 while the model loads would end us.
    xscale.catch_stop_signals()
    if os.environ.get("RANK", "0") != "0":  # one set of progress bars per job, not per rank
        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
    elif not sys.stderr.isatty():
        # In a job's output a bar drawn in place is one line, and srun --label cuts a line every
        # 1024 bytes: map()'s bars over IMDB's 25,000 reviews make several KB (Trainer's are drawn
        # as lines, xscale.hf).
        datasets.disable_progress_bars()
    model_path = resolve_model(args.pretrained_model)
    splits = load_reviews(args.dataset)
    output_dir = os.path.join(args.output_path, args.model_name)
    logging_dir = os.path.join(args.logging_path, args.model_name)
    training_args = training_arguments(args, output_dir)  # joins the process group

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.pad_token = tokenizer.eos_token  # GPT-neo has no pad token
    model = load_model(model_path, args.attention)
    model.config.pad_token_id = model.generation_config.pad_token_id = tokenizer.pad_token_id
    train_set, validation_set, test_set = tokenize(splits, tokenizer, args.max_length,
                                                   args.num_workers)
    trainer = hf.XscaleTrainer(
        model=model,
        args=training_args,
        processing_class=tokenizer,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        train_dataset=train_set,
        eval_dataset=validation_set,
        callbacks=[hf.tensorboard(logging_dir)],
        resume=args.resume is not False,
        checkpoint_every="auto" if args.save_steps == "auto" else None,
        report_at_end=False,  # the summary carries the perplexities below
        name=TRAINER,
    )
    is_main = trainer.is_world_process_zero()
    if is_main:
        print(f"Model {model_path}: {model.num_parameters():,} parameters; "
              f"{len(train_set):,} training sequences of up to {args.max_length} tokens",
              flush=True)
        if args.resume and trainer.resume_from is None:
            print(f"No checkpoint in {output_dir} yet: starting from {model_path}", flush=True)
    trainer.train()

    results: dict[str, float] = {}
    if not trainer.stopped:  # after a signal the time left is for the checkpoint only
        # By name, not as evaluate(test_set): with persistent workers Trainer reuses the data
        # loader of an unnamed eval set, and would report the validation loss as the test loss.
        trainer.eval_dataset = {"validation": validation_set, "test": test_set}
        losses = trainer.evaluate()
        results = {
            "eval_loss": losses["eval_validation_loss"],
            "perplexity": math.exp(losses["eval_validation_loss"]),
            "test_perplexity": math.exp(losses["eval_test_loss"]),
        }
        if is_main:
            print(f"Perplexity on validation: {results['perplexity']:.2f}")
            print(f"Perplexity on test: {results['test_perplexity']:.2f}")
            if args.sample_reviews:
                sample_reviews(trainer.model, tokenizer, args.sample_reviews)
    trainer.report(**results, attention=model.config._attn_implementation,
                   compiled=args.compile)
    return 0


def main(argv: list[str] | None = None) -> int:
    return train(parse_args(argv))


if __name__ == "__main__":
    # Data-loader workers are not forks of this process: forking after the ROCm/CUDA runtime and
    # its threads exist can hang or crash the workers (pytorch/pytorch#119845), as the LUMI
    # workshop found. Under spawn xscale makes them forks of a fork server, a fresh interpreter
    # that imports this file and torch once (xscale.lifecycle.worker_context).
    torch.multiprocessing.set_start_method("spawn")
    # Under spawn, tqdm's default multiprocessing lock is a named semaphore that the resource
    # tracker reports as "leaked" on every rank once xscale's shutdown leaves through os._exit.
    # Only this process draws bars (workers and map() processes do not): a thread lock will do.
    tqdm.tqdm.set_lock(threading.RLock())
    xscale.run_and_exit(main, prog=PROG)
