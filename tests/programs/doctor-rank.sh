#!/usr/bin/env bash
# Test-bed wrapper around one rank of a command (runscripts/doctor in tests/test_doctor.py): what
# a real node or launcher gets wrong, made to happen at a known moment.
#
#   doctor-rank.sh [--hold DIR] [--env NODE:LOCALID:NAME=VALUE]... -- CMD [ARGS...]
#
#   --hold DIR   write DIR/ready-RANK, then wait (bounded) for DIR/go: the test breaks a node after
#                every rank has started (Slurm can still launch there) and before any check runs
#   --env ...    on NODE, for local rank LOCALID only, export NAME=VALUE: a launcher that gave
#                one rank the wrong setting
set -euo pipefail

hold_dir=""
while (($#)); do
  case $1 in
    --hold) hold_dir=$2; shift 2 ;;
    --env)
      IFS=: read -r node local_id assignment <<<"$2"
      if [[ $node == "${SLURMD_NODENAME:-}" && $local_id == "${SLURM_LOCALID:-}" ]]; then
        export "${assignment?}"
      fi
      shift 2 ;;
    --) shift; break ;;
    *) printf 'doctor-rank.sh: error: unknown option %s\n' "$1" >&2; exit 2 ;;
  esac
done

if [[ -n $hold_dir ]]; then
  : >"$hold_dir/ready-$SLURM_PROCID"
  deadline=$((SECONDS + 120))
  until [[ -e $hold_dir/go ]]; do
    ((SECONDS < deadline)) || { echo "doctor-rank.sh: error: no $hold_dir/go after 120 s" >&2; exit 2; }
    sleep 0.1
  done
fi
exec "$@"
