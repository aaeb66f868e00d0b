# shellcheck shell=bash
# The entrypoints' sequence: xs_setup_environment (every export, in order; run.sh, run-profile.sh
# and doctor) and xs_main (the command line and the exec; run.sh and run-profile.sh), with the
# steps that belong to no one concern: the image's Python, rank 0's announcement and the start-up
# times.
#
# Sourced last by run.sh, run-profile.sh and doctor; the functions it calls are in the files
# sourced before it (args.sh and profiling.sh only where xs_main needs them).

# Every export, in order: what run.sh, run-profile.sh and doctor set up before their command.
xs_setup_environment() {
  xs_detect_launcher
  xs_derive_layout
  xs_export_layout
  xs_master_addr
  xs_master_port
  xs_detect_site
  xs_setup_cache
  xs_threads
  xs_failure_defaults
  xs_load_site
  xs_bind_gpus
  xs_debug
  xs_default XSCALE_SITE "$XS_SITE"
  xs_default XSCALE_LAUNCHER "$XS_LAUNCHER"
}

# The entrypoints' shared main. MODE is "plain" (run.sh) or "profile" (run-profile.sh, which
# sources profiling.sh); each entrypoint defines its own usage().
xs_main() {
  local mode=$1 print_env=0
  shift
  case ${1:-} in
    -h | --help) usage; exit 0 ;;
    --print-env) print_env=1; shift ;;
    --) shift ;;
  esac
  xs_setup_environment
  [[ $mode == profile ]] && xs_setup_profiling
  if ((print_env)); then
    xs_print_env
    exit 0
  fi
  (($#)) || xs_die "no command given (usage: $XS_PROG CMD [ARGS...]; see --help)"
  xs_check_socket_interfaces
  xs_activate_container_python
  [[ $mode == profile ]] && xs_check_profiler
  xs_expand_args "$@"
  xs_announce "${XS_ARGS[@]}"
  xs_export_startup_times
  if [[ $mode == profile ]] && ((XS_PROFILE_THIS_RANK && ${#XS_PROFILER_WORDS[@]})); then
    exec "${XS_PROFILER_WORDS[@]}" "${XS_ARGS[@]}"
  fi
  exec "${XS_ARGS[@]}"
}

# LUMI's AMD images define WITH_CONDA ("source .../activate pytorch") and expect it to run before
# python; the EasyBuild images put a venv under /user-software. Both come from the image, never
# from the user's arguments, and run in this shell (no eval: split into words, run as a command).
xs_activate_container_python() {
  local venv
  for venv in /user-software/venv/*/bin; do
    [[ -x $venv/python && :$PATH: != *":$venv:"* ]] && export PATH="$venv:$PATH"
    break
  done
  [[ -n ${WITH_CONDA:-} ]] || return 0
  local -a words
  read -r -a words <<<"$WITH_CONDA"
  ((${#words[@]})) || return 0
  # Activation scripts read unset variables; relax -u only for them.
  set +u
  "${words[@]}" >/dev/null || xs_die "WITH_CONDA ('$WITH_CONDA') failed"
  set -u
}

# Rank 0 names the launcher, site and rendezvous once (ARGS: the command, whose own rendezvous
# wins for the trainer); XSCALE_VERBOSE=1 has every rank name its node, CPUs and GPUs.
xs_announce() {
  local own="" unused=""
  if ((XS_RANK == 0)); then
    xs_command_rendezvous own "$@"
    if [[ -n $own && $own != *"$MASTER_ADDR:$MASTER_PORT"* && $own != *[=\ ]"$MASTER_PORT" \
          && $own != *[=\ ]"$MASTER_ADDR" ]]; then
      unused=" (not used: the command's own $own wins)"
    fi
    printf 'xscale: launcher=%s site=%s world=%s nodes=%s master=%s:%s%s\n' "$XS_LAUNCHER" \
      "$XS_SITE" "$XS_WORLD_SIZE" "$XS_NNODES" "$MASTER_ADDR" "$MASTER_PORT" "$unused" >&2
  fi
  if [[ ${XSCALE_VERBOSE:-0} == 1 ]]; then
    local line cpus=""
    local -a status
    mapfile -t status </proc/self/status
    for line in "${status[@]}"; do [[ $line == Cpus_allowed_list:* ]] && cpus=${line#*:}; done
    printf 'xscale: rank=%s local_rank=%s node=%s cpus=%s gpus=%s\n' "$XS_RANK" "$XS_LOCAL_RANK" \
      "${SLURMD_NODENAME:-$HOSTNAME}" "${cpus//[[:space:]]/}" \
      "${ROCR_VISIBLE_DEVICES:-${CUDA_VISIBLE_DEVICES:-${ZE_AFFINITY_MASK:-all}}}" >&2
  fi
}

# xs_command_rendezvous OUT ARGS...: OUT=the rendezvous the command names itself, which the
# trainer uses instead of MASTER_ADDR:MASTER_PORT: a tcp:// or file:// address (pytorch/examples'
# `--dist-url tcp://nid001:45678`, `init_method=tcp://...`) or a --master-port/--master-addr
# option; "" when it names none (env://, the torchrun variables, is run.sh's own).
xs_command_rendezvous() {
  local out=$1 arg previous=""
  shift
  printf -v "$out" '%s' ""
  for arg in "$@"; do
    case $arg in
      -*tcp://* | -*file://*) printf -v "$out" '%s' "$arg"; return ;;
      *tcp://* | *file://*)
        [[ $previous == -* ]] && arg="$previous $arg"
        printf -v "$out" '%s' "$arg"
        return
        ;;
      --master[-_]port=* | --master[-_]addr=*) printf -v "$out" '%s' "$arg"; return ;;
    esac
    case $previous in
      --master[-_]port | --master[-_]addr) printf -v "$out" '%s' "$previous $arg"; return ;;
    esac
    previous=$arg
  done
}

# Start-up phases (docs/STARTUP.md): the trainer reports how long each rank took from the
# step's launch to run.sh (XSCALE_LAUNCH_T, set by jobs/lib/supervisor.py), through run.sh, to
# the exec. Two reads of bash's clock, no fork. Always overwritten, never xs_default: a value
# inherited from an outer run.sh would be another process's time. Not in --print-env, whose
# output must not change from one run to the next. EPOCHREALTIME is empty before bash 5; the
# trainer then reports these phases as unknown.
xs_export_startup_times() {
  export XSCALE_T_RUNSH=${XS_T_RUNSH:-}
  export XSCALE_T_EXEC=${EPOCHREALTIME:-}
}
