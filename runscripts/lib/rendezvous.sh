# shellcheck shell=bash
# Rendezvous: MASTER_ADDR (the first node, from the launcher's node list) and MASTER_PORT (from the
# job and step ids), the address every rank of a step meets at. A value the user set is checked,
# not trusted. Reads the layout (layout.sh: XS_WORLD_SIZE, XS_LAUNCHER).
#
# Sourced by run.sh, run-profile.sh and doctor, after common.sh and layout.sh. It sources
# hostlist.sh, the bash parser of Slurm's node lists (get-master sources it too).

# shellcheck source=runscripts/lib/hostlist.sh
source "$XS_LIB_DIR/hostlist.sh"

# MASTER_ADDR is best set by the job script, outside the container; without it, the first host of
# the Slurm node list (parsed here: there are no Slurm tools inside the container) or of PBS's
# node file. A value the user set is checked, not trusted: an empty one (a failed
# `$(scontrol ...)` in the job script) or one with blanks would only fail later, inside torch.
xs_master_addr() {
  if [[ -v MASTER_ADDR ]]; then
    [[ -n $MASTER_ADDR ]] || xs_die "MASTER_ADDR is set but empty; export the first node's name, or unset it"
    [[ $MASTER_ADDR != *[[:space:]]* ]] \
      || xs_die "MASTER_ADDR='$MASTER_ADDR' contains blanks; it must be one host name or address"
    xs_default MASTER_ADDR "$MASTER_ADDR"
    return
  fi
  local list first
  if xs_first_set list SLURM_STEP_NODELIST,SLURM_JOB_NODELIST,SLURM_NODELIST; then
    xs_hostlist_first "$list" || xs_die "$XS_SOURCE_VAR: $XS_HOSTLIST_ERROR"
    first=$XS_FIRST_HOST
  elif [[ -n ${PBS_NODEFILE:-} ]]; then
    [[ -r $PBS_NODEFILE ]] || xs_die "PBS_NODEFILE '$PBS_NODEFILE' is not readable"
    read -r first <"$PBS_NODEFILE" || true
    [[ -n $first ]] || xs_die "PBS_NODEFILE '$PBS_NODEFILE' is empty"
  elif (( XS_WORLD_SIZE == 1 )); then
    first=127.0.0.1
  else
    xs_die "MASTER_ADDR is not set and launcher '$XS_LAUNCHER' does not say which node is first; export MASTER_ADDR in the job script"
  fi
  xs_default MASTER_ADDR "$first"
}

# Launcher variables that name the job (or the MPI application) and are the same on every rank,
# for MPI launches outside a scheduler: PMIx's namespace (Open MPI 5, and any PMIx launcher),
# Open MPI 4's job id, Cray PALS's application id.
XS_JOB_NAME_VARS=PMIX_NAMESPACE,OMPI_MCA_ess_base_jobid,OMPI_MCA_orte_ess_jobid,PALS_APID

# xs_string_hash OUT STRING: OUT=32-bit FNV-1a hash of STRING's characters, in bash arithmetic
# (no process); the same string gives the same number on every rank.
xs_string_hash() {
  local text=$2 code i hash=2166136261
  for ((i = 0; i < ${#text}; i++)); do
    printf -v code '%d' "'${text:i:1}"
    hash=$(( ((hash ^ code) * 16777619) & 0xffffffff ))
  done
  printf -v "$1" '%d' "$hash"
}

# MASTER_PORT = 10000 + (16 * job id + step id mod 16) mod 22768, the same on every rank of a
# step. Up to 16 concurrent steps of one job get distinct ports, and so do the steps of jobs whose
# ids are fewer than 22768 / 16 = 1423 apart (the usual neighbours on a shared node); the range
# 10000-32767 stays below Linux's ephemeral ports (32768+), so an outgoing connection cannot
# already hold it. A fixed 29500 makes every second job on a node fail with "address already in
# use". Without a scheduler job id, a hash of the MPI launcher's job name stands in for it.
xs_master_port() {
  if [[ -v MASTER_PORT ]]; then
    # Five digits at most before the arithmetic, so that a long number cannot wrap into range.
    if [[ ! $MASTER_PORT =~ ^[0-9]{1,5}$ ]] || (( 10#$MASTER_PORT < 1 || 10#$MASTER_PORT > 65535 )); then
      xs_die "MASTER_PORT='$MASTER_PORT' is not a port number (a whole number from 1 to 65535)"
    fi
    xs_default MASTER_PORT "$MASTER_PORT"
    return
  fi
  local job="" step=0 launch_name
  if [[ -n ${SLURM_JOB_ID:-} ]]; then
    job=$SLURM_JOB_ID step=${SLURM_STEP_ID:-0}
  elif [[ ${PBS_JOBID:-} =~ ^([0-9]+) ]]; then
    job=${BASH_REMATCH[1]}
  elif xs_first_set launch_name "$XS_JOB_NAME_VARS"; then
    xs_string_hash job "$launch_name"
  elif (( XS_WORLD_SIZE == 1 )); then
    job=$$   # a lone process: any port that differs between processes will do
  else
    xs_die "MASTER_PORT is not set and launcher '$XS_LAUNCHER' gives no job id to derive it from; export MASTER_PORT"
  fi
  [[ $job =~ ^[0-9]{1,18}$ ]] || xs_die "job id '$job' is not a number; export MASTER_PORT"
  [[ $step =~ ^[0-9]{1,9}$ ]] || step=0   # "batch"/"extern" steps never host a rendezvous
  xs_default MASTER_PORT "$((10000 + (16 * (10#$job % 22768) + 10#$step % 16) % 22768))"
}
