# shellcheck shell=bash
# Slurm hostlist -> first host, in pure bash: sourced by rendezvous.sh (MASTER_ADDR) and
# get-master.
#
# run.sh sources this (through rendezvous.sh) on every rank, so the first-host path uses bash
# builtins only: no subshell, no external command, no Python (a fork plus exec costs more than the
# whole parse).
# Sourcing defines functions only; nothing runs, prints or changes at source time.
#
# Contract:
#   xs_hostlist_first LIST
#     0: XS_FIRST_HOST is the first host `scontrol show hostnames LIST` would print,
#        XS_HOSTLIST_ERROR is empty.
#     2: LIST is malformed; XS_FIRST_HOST is empty and XS_HOSTLIST_ERROR says why, quoting LIST
#        (one line, no "name: error:" prefix).
#   It never exits, prints or forks, is safe under `set -euo pipefail`, and overwrites
#   BASH_REMATCH (every [[ =~ ]] does).
#
# What is validated: the syntax of the whole LIST (the same table of checks, in the same order,
# as hostlist.py, so both paths reject the same malformed lists with the same words), and the
# numbers of the ranges that make the first host: the first element of every bracket of the
# first item (order, Slurm's 65536-hosts-per-range limit, at most 18 digits). A bad range
# elsewhere, e.g. the 5-2 in `a[1,5-2]`, is reported by `get-master --all` (hostlist.py), which
# checks every range: checking them here would mean a bash loop over every element, about 6 ms
# per 1000 elements (30 ms for a fragmented 10,000-node list) on every rank.
#
# Trailing text after the last bracket (`node[1-2]-ib`) is expanded as node1-ib, node2-ib.
# Slurm 22.05 rejects it ("Invalid hostlist", exit 0), but newer Slurm's hostlist_create accepts
# a suffix there on one-dimensional clusters and prints prefix+number+suffix, so a node list
# written that way is meant as the obvious expansion.

xs_hostlist_first() {
  # glibc's regex runs ~15x slower in a UTF-8 locale, and host names are bytes anyway; the
  # local copy is restored when the function returns.
  local LC_ALL=C
  # The helpers read `list` from here (bash scoping is dynamic): handing a 40 KB list to each
  # as an argument would copy it per call, ~70 us each.
  local list=$1
  XS_FIRST_HOST=
  XS_HOSTLIST_ERROR=
  xs_hostlist_looks_well_formed || xs_hostlist_check_syntax || return 2
  xs_hostlist_walk_first_item || return 2
  return 0
}

# Status 0 when LIST is well formed; status 1 when it may not be, and xs_hostlist_check_syntax
# then says whether and why. Each ERE here is the union of rows of that table (the rows for '[]'
# and a nested '[' are inside the wider rows below them), and together they match exactly the
# lists it rejects: a well-formed list pays for six regexes instead of thirteen (on a fragmented
# 10,000-node list, about 2 ms instead of 3.4 ms). Add a row there, add it here too.
xs_hostlist_looks_well_formed() {
  local pattern
  for pattern in \
    '^([[:space:]]*(,|$)|[^][]*\])' \
    ',[[:space:]]*(,|$)' \
    '\][^[]*\]' \
    '\[[^0-9]' \
    '\[[^]]*([^]0-9,-]|[,-][^0-9]|-[0-9]*-)' \
    '\[[^]]*$'; do
    [[ $list =~ $pattern ]] && return 1
  done
  return 0
}

# First match wins: each ERE matches only malformed lists, and comes with the reason. Keep in step
# with SYNTAX_CHECKS in hostlist.py (the tests compare the two messages) and with the union
# regexes of xs_hostlist_looks_well_formed above. One ERE per row, not
# one alternation: glibc tries an unanchored regex at every position its first characters allow,
# so an alternation with one ^-anchored branch costs ten times the two regexes on a long list.
xs_hostlist_check_syntax() {
  local -a patterns=() reasons=()
  local unmatched_close="']' without a matching '['" unmatched_open="'[' without a matching ']'"
  local bad_bracket="brackets must hold numbers or ranges N-M, separated by ','"
  patterns+=('^[[:space:]]*$') reasons+=('it names no host')
  patterns+=('^[[:space:]]*,') reasons+=("it starts with ','")
  patterns+=(',[[:space:]]*$') reasons+=("it ends with ','")
  patterns+=(',[[:space:]]*,') reasons+=("it has an empty item (',,')")
  patterns+=('^[^][]*\]') reasons+=("$unmatched_close")
  patterns+=('\][^[]*\]') reasons+=("$unmatched_close")
  patterns+=('\[[^]]*\[') reasons+=("$unmatched_open")
  patterns+=('\[[^]]*$') reasons+=("$unmatched_open")
  patterns+=('\[\]') reasons+=("empty brackets '[]'")
  patterns+=('\[[^]]*[^]0-9,-]') reasons+=("brackets may hold only digits, ',' and '-'")
  patterns+=('\[[^0-9]') reasons+=("$bad_bracket")
  patterns+=('\[[^]]*[,-][^0-9]') reasons+=("$bad_bracket")
  patterns+=('\[[^]]*-[0-9]*-') reasons+=("$bad_bracket")
  local i
  for i in "${!patterns[@]}"; do
    if [[ $list =~ ${patterns[i]} ]]; then
      xs_hostlist_fail "${reasons[i]}"
      return 1
    fi
  done
  return 0
}

# REASON: the error message, with the list on one line whatever separators it used.
xs_hostlist_fail() {
  local shown=${list//$'\n'/\\n}
  shown=${shown//$'\t'/\\t}
  shown=${shown//$'\r'/\\r}
  # shellcheck disable=SC2034 # a result: the caller reads it
  XS_HOSTLIST_ERROR="invalid hostlist '$shown': $1"
}

# The first host is the first item's literal text with every bracket replaced by the low end of
# its first range, zero padding kept: Slurm pads each number to the width of that low end.
# Runs on a list that passed xs_hostlist_check_syntax, so brackets are balanced and well formed.
# Every regex here is anchored and stops early, or jumps to the next ']' (glibc skips ahead to
# it), so a 10,000-node list costs a few string copies, not a walk over its elements.
xs_hostlist_walk_first_item() {
  local rest=$list low high host=
  if [[ $rest =~ ^[[:space:]]+ ]]; then
    rest=${rest:${#BASH_REMATCH[0]}}
  fi
  while :; do
    # Text up to the next bracket or separator, then the bracket's first range if any.
    [[ $rest =~ ^([^][,[:space:]]*)(\[([0-9]+)(-([0-9]+))?)? ]] || break
    host+=${BASH_REMATCH[1]}
    [[ -n ${BASH_REMATCH[2]} ]] || break
    low=${BASH_REMATCH[3]} high=${BASH_REMATCH[5]}
    xs_hostlist_check_range "$low" "$high" || return 1
    host+=$low
    # The item may go on after the bracket: a suffix or another bracket.
    [[ $rest =~ \](.*) ]] || break
    rest=${BASH_REMATCH[1]}
  done
  # shellcheck disable=SC2034 # the result: the caller reads it
  XS_FIRST_HOST=$host
  return 0
}

# LOW [HIGH]: Slurm's numeric rules for one range (HIGH empty for a single number).
xs_hostlist_check_range() {
  local low=$1 high=${2:-$1} max_hosts=65536 # Slurm's MAX_RANGE (hostlist.c)
  # Beyond 18 digits bash arithmetic (signed 64-bit) overflows; no real node number is that long.
  if ((${#low} > 18 || ${#high} > 18)); then
    xs_hostlist_fail "number ${low}${2:+-$2} has more than 18 digits"
    return 1
  fi
  if ((10#$high < 10#$low)); then
    xs_hostlist_fail "descending range $low-$high"
    return 1
  fi
  if ((10#$high - 10#$low + 1 > max_hosts)); then
    xs_hostlist_fail "range $low-$high holds more than $max_hosts hosts (Slurm's limit)"
    return 1
  fi
  return 0
}
