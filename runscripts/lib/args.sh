# shellcheck shell=bash
# The command's arguments: byte-exact, except $NAME / ${NAME} naming an exported variable,
# expanded per rank (XSCALE_EXPAND_ARGS=0 turns that off). No eval: the arguments are data.
#
# Sourced by run.sh and run-profile.sh (xs_main calls it), after common.sh.

# LUMI's workshop scripts pass '--rank \$SLURM_PROCID' so that each rank sees its own number; we
# expand exactly that form and nothing else: ${X:-y}, $(...), $1, a lone $ and names not exported
# stay as typed.
xs_expand_args() {
  XS_ARGS=()
  local arg
  if [[ ${XSCALE_EXPAND_ARGS:-1} == 0 ]]; then
    XS_ARGS=("$@")
    return 0
  fi
  for arg in "$@"; do
    [[ $arg == *'$'* ]] && xs_expand_one arg
    XS_ARGS+=("$arg")
  done
}

xs_expand_one() {
  local rest=${!1} out="" name
  local re_braced='^\{([A-Za-z_][A-Za-z0-9_]*)\}(.*)$' re_plain='^([A-Za-z_][A-Za-z0-9_]*)(.*)$'
  while [[ $rest == *'$'* ]]; do
    out+=${rest%%'$'*}
    rest=${rest#*'$'}
    if [[ $rest =~ $re_braced || $rest =~ $re_plain ]]; then
      name=${BASH_REMATCH[1]}
      if [[ -v $name && ${!name@a} == *x* ]]; then
        out+=${!name}
        rest=${BASH_REMATCH[2]}
        continue
      fi
    fi
    out+='$'
  done
  printf -v "$1" '%s' "$out$rest"
}
