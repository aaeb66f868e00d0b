"""xscale: the runtime library of the trainers in python/, installable as a package.

`pip install .` (or `-e .`) in the checkout installs it with the `xscale` command
(pyproject.toml); xscale's images install it. A trainer run as `python python/NAME.py` finds
the package beside it all the same. A trainer keeps its model, data and step, and goes through
`runtime` for everything else. Imports run one way, down this list:

    runtime     start(), Loop (Loop.from_args: the trainers' common command line):
                micro-batches and accumulation, checkpoint cadence, the stop vote every N
                steps, the end of a run and its XSCALE_SUMMARY
    hf, ds      adapters: Hugging Face's Trainer (XscaleTrainer, callbacks), DeepSpeed
    vision      the ImageNet trainers' command line, data and models; any classifier's
                evaluation over every rank's shard
    checkpoint  atomic checkpoints, found by step; resume and save for plain DDP
    data        resumable samplers and DataLoaders with shielded workers
    profiling   the PROFILE_STEPS window; staging: tarballs unpacked once per node
    stragglers  each rank's own work per step, compared at every log interval: the slow rank
    runlog      the loss log (tqdm, TensorBoard); XSCALE_RANK, the XSCALE_SUMMARY line and
                the whole summary in OUTPUT_DIR/xscale-summary.json
    throughput  samples and tokens per second, per rank and summed
    reductions  sums over ranks (one all_reduce), small records gathered to rank 0
    dist        placement from run.sh's variables, device (torch.accelerator), backend, group
    lifecycle   user errors, stop signals, shielded child processes, failure hooks, the exit
    flight      a failed rank's flight record, for the step supervisor to name a hung rank
    progress    rank 0's progress notes, for the step supervisor's goodput ledger
    startup     the start-up phases (launch, run.sh, imports, group, first step): stdlib only
    report      `xscale report JOB_OUTPUT|SUMMARY.json`: a readable summary of a run
    goodput_model  `xscale goodput-model`: requeue vs spares over a long campaign
    __main__    the `xscale` command: its subcommands are the two above
    records, archive   the XSCALE_* line reader and staging's unpack-and-publish, which the
                batch host's programs (jobs/lib/) load by path: Python 3.6, stdlib, no imports

Importing the package, or any module of it, does no work: the start-up's `imports` moment is
marked by the first call that starts a run (runtime.start(), hf.device_and_backend()), once the
trainer's imports, xscale's own modules among them, are really done. Heavy modules that only some
runs need (torch.distributed.checkpoint, torchvision) are imported where they are used.
"""
