# shellcheck shell=bash
# Site profile: anything not recognised (laptops, CI, CPU-only clusters, the virtual cluster).
#
# Sourced by runscripts/lib/site.sh once per rank. Sets nothing site-specific: the
# launcher variables and node-local caches that run.sh exports are all a generic machine needs.

# shellcheck disable=SC2034  # read by lib/binding.sh: no GPU visibility variables to narrow
XS_GPU_VENDOR=none
# shellcheck disable=SC2034  # read by lib/profiling.sh: a sampling profiler that needs no GPU
XS_PROFILER_DEFAULT='py-spy record -o {dir}/rank{rank}.svg --'

# Hugging Face's Trainer (accelerate) makes placed ranks data-parallel on CPUs only when told the
# CPU is meant (TrainingArguments(use_cpu=True) or ACCELERATE_USE_CPU); without, every rank of a
# CPU-only node would train alone, silently. Told only where no GPU's device file exists (an AMD
# or Intel workstation is "generic" too: lib/site.sh, xs_has_gpu_device).
xs_has_gpu_device || xs_default ACCELERATE_USE_CPU true
