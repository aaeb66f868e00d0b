# shellcheck shell=bash
# What every part of the per-rank environment uses: one-line errors (xs_die), defaults the user
# can override (xs_default, which also records the name for --print-env), and reading
# comma-separated lists of variables without a process. Sourced first by run.sh, run-profile.sh
# and doctor, before the other lib/ files, which call these helpers.
#
# All of lib/ runs once per rank before the trainer starts, on thousands of ranks at once, so it
# uses bash builtins only: no subshells, no external commands on the common path. A forked process
# costs about a millisecond; Python costs tens. bash's parsing costs time in proportion to the
# text it reads, so each entrypoint sources only the files it calls.
#
# Contract (docs/ARCHITECTURE.md, "runscripts/"): every default can be overridden by setting the
# variable first; every value read from the environment is checked, and a bad one is one line on
# stderr and exit 2, before anything runs. Sourcing defines functions and XS_ variables only.

# shellcheck disable=SC2034  # read by the entrypoints and the lib/ files sourced after this one
XS_LIB_DIR=${BASH_SOURCE[0]%/*}
XS_PROG=${XS_PROG:-run.sh}
XS_EXPORTED=()   # every name we export, for --print-env
XS_NOTES=()      # where a computed value came from, for --print-env

# Errors are one line whatever the bad value holds: newlines and carriage returns in it are shown
# as \n and \r.
xs_die() {
  local message=$*
  message=${message//$'\n'/\\n}
  message=${message//$'\r'/\\r}
  printf '%s: error: %s\n' "$XS_PROG" "$message" >&2
  exit 2
}

xs_warn() {
  printf '%s: warning: %s\n' "$XS_PROG" "$*" >&2
}

# xs_default NAME VALUE: export NAME=VALUE unless the user already set NAME (the user wins).
xs_default() {
  [[ -v $1 ]] || export "$1=$2"
  XS_EXPORTED+=("$1")
}

# xs_note TEXT: say in --print-env where a value came from ("OMP_NUM_THREADS=2: ...").
xs_note() {
  XS_NOTES+=("$*")
}

# --print-env: the notes as comments ('#' sorts before every name, and a shell or an env file
# that reads the output skips them), then every name xs_default recorded, once, as NAME=VALUE in
# C-locale order.
xs_print_env() {
  local name
  local -A printed=()
  local -a lines=()
  for name in "${XS_EXPORTED[@]}"; do
    [[ -n ${printed[$name]:-} ]] && continue
    printed[$name]=1
    lines+=("$name=${!name}")
  done
  ((${#XS_NOTES[@]} == 0)) || printf '# %s\n' "${XS_NOTES[@]}"
  printf '%s\n' "${lines[@]}" | LC_ALL=C sort
}

# xs_split_commas STRING: XS_ITEMS=the comma-separated fields of STRING. Parameter expansion
# only: a here-string costs a temporary file or pipe per call, which adds up on every rank.
xs_split_commas() {
  local rest=$1
  XS_ITEMS=()
  while [[ $rest == *,* ]]; do
    XS_ITEMS+=("${rest%%,*}")
    rest=${rest#*,}
  done
  XS_ITEMS+=("$rest")
}

# xs_first_set OUT "A,B,...": OUT=value of the first of the listed variables that is set (and
# XS_SOURCE_VAR=its name, for error messages). Returns 1 when none is, or the list is "-".
xs_first_set() {
  local name
  printf -v "$1" '%s' ""
  [[ $2 == - ]] && return 1
  xs_split_commas "$2"
  for name in "${XS_ITEMS[@]}"; do
    if [[ -n ${!name:-} ]]; then
      printf -v "$1" '%s' "${!name}"
      # shellcheck disable=SC2034  # read by the callers, in their error messages
      XS_SOURCE_VAR=$name
      return 0
    fi
  done
  return 1
}
