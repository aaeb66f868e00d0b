# shellcheck shell=bash
# This rank's place in the job: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK and
# NNODES, read from whichever launcher started it (the launcher table below), completed where the
# launcher is silent, checked (also against a value the user exported), and exported under the
# names torchrun uses. Sets XS_LAUNCHER and XS_RANK ... XS_NNODES, which the other lib/ files
# read.
#
# Sourced by run.sh, run-profile.sh and doctor, after common.sh.

XS_LAUNCHER=none

# Launchers, as data. One row per launcher, in priority order; a launcher applies when every
# variable of its "detect" column is set. The other columns name the variable holding each value
# ("A,B": the first of A, B that is set; "-": derived below). torchrun is known by the run id its
# agent always sets: RANK and WORLD_SIZE alone may be a job script's stale exports. Slurm needs
# SLURM_STEP_ID because a batch script's own shell also has SLURM_PROCID=0 and must not pass for
# rank 0 of a step. "manual" is RANK and WORLD_SIZE set by hand (or by a launcher not listed).
#  launcher  detect                                   rank                  local_rank                      world_size                  local_world_size                 node_rank           nnodes
XS_LAUNCHERS=(
  "torchrun  TORCHELASTIC_RUN_ID,RANK,WORLD_SIZE      RANK                  LOCAL_RANK                      WORLD_SIZE                  LOCAL_WORLD_SIZE                 GROUP_RANK          NNODES"
  "slurm     SLURM_PROCID,SLURM_STEP_ID               SLURM_PROCID          SLURM_LOCALID                   SLURM_NTASKS,SLURM_NPROCS   -                                SLURM_NODEID        SLURM_STEP_NUM_NODES,SLURM_NNODES"
  "pbs       PALS_RANKID                              PALS_RANKID           PALS_LOCAL_RANKID               PMI_SIZE                    PALS_LOCAL_SIZE,PMI_LOCAL_SIZE   PALS_NODEID         -"
  "openmpi   OMPI_COMM_WORLD_RANK                     OMPI_COMM_WORLD_RANK  OMPI_COMM_WORLD_LOCAL_RANK      OMPI_COMM_WORLD_SIZE        OMPI_COMM_WORLD_LOCAL_SIZE       -                   -"
  "pmi       PMI_RANK                                 PMI_RANK              MPI_LOCALRANKID,PMI_LOCAL_RANK  PMI_SIZE                    MPI_LOCALNRANKS,PMI_LOCAL_SIZE   -                   -"
  "manual    RANK,WORLD_SIZE                          RANK                  LOCAL_RANK                      WORLD_SIZE                  LOCAL_WORLD_SIZE                 NODE_RANK,GROUP_RANK NNODES"
)

# The rank variables run.sh exports; XS_NAME holds this rank's value of NAME.
XS_LAYOUT_NAMES=(RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE NODE_RANK NNODES)
# Which launcher variable said each value (XS_SAID[WORLD_SIZE]=SLURM_NTASKS); a value the
# launcher does not say (derived below) has no entry.
declare -A XS_SAID=()

# True when every variable in the comma-separated list is set and non-empty.
xs_all_set() {
  local name
  xs_split_commas "$1"
  for name in "${XS_ITEMS[@]}"; do
    [[ -n ${!name:-} ]] || return 1
  done
}

# Fill XS_RANK ... XS_NNODES from the first launcher row that applies ("" where the row has no
# variable; xs_derive_layout completes those).
xs_detect_launcher() {
  local row name detect rank local_rank world local_world node nnodes
  XS_RANK=0 XS_LOCAL_RANK=0 XS_WORLD_SIZE=1 XS_LOCAL_WORLD_SIZE=1 XS_NODE_RANK=0 XS_NNODES=1
  XS_LAUNCHER=none
  for row in "${XS_LAUNCHERS[@]}"; do
    # Our own table: split on blanks, no glob characters in it.
    # shellcheck disable=SC2086
    set -- $row
    name=$1 detect=$2 rank=$3 local_rank=$4 world=$5 local_world=$6 node=$7 nnodes=$8
    xs_all_set "$detect" || continue
    XS_LAUNCHER=$name
    xs_read_number RANK "$rank"
    xs_read_number LOCAL_RANK "$local_rank"
    xs_read_number WORLD_SIZE "$world"
    xs_read_number LOCAL_WORLD_SIZE "$local_world"
    xs_read_number NODE_RANK "$node"
    xs_read_number NNODES "$nnodes"
    return 0
  done
}

# xs_read_number NAME VARLIST: XS_NAME=the value, checked to be a whole number, or "" if none of
# VARLIST is set; XS_SAID[NAME] records which launcher variable said it.
xs_read_number() {
  local value
  if xs_first_set value "$2"; then
    [[ $value =~ ^[0-9]+$ ]] \
      || xs_die "$XS_SOURCE_VAR='$value' is not a whole number (launcher: $XS_LAUNCHER)"
    # Nine digits keep the arithmetic below exact; no launcher numbers a billion ranks.
    ((${#value} <= 9)) || xs_die "$XS_SOURCE_VAR='$value' is out of range (launcher: $XS_LAUNCHER)"
    printf -v "XS_$1" '%d' "$((10#$value))"
    XS_SAID[$1]=$XS_SOURCE_VAR
  else
    printf -v "XS_$1" '%s' ""
  fi
}

# Slurm gives tasks per node in compressed form, e.g. "8(x2),4": 8 on each of the first two
# nodes, 4 on the third. Return the count for node index $2. Every number is read as decimal
# (10#): bash would take "08" for a bad octal number.
xs_tasks_on_node() {
  local node=$2 group count repeat
  xs_split_commas "$3"
  for group in "${XS_ITEMS[@]}"; do
    if [[ $group =~ ^([0-9]{1,9})\(x([0-9]{1,9})\)$ ]]; then
      count=$((10#${BASH_REMATCH[1]})) repeat=$((10#${BASH_REMATCH[2]}))
    elif [[ $group =~ ^[0-9]{1,9}$ ]]; then
      count=$((10#$group)) repeat=1
    else
      xs_die "cannot read tasks per node '$3'"
    fi
    if (( node < repeat )); then
      printf -v "$1" '%d' "$count"
      return 0
    fi
    node=$((node - repeat))
  done
  xs_die "node $2 is not in tasks per node '$3'"
}

# Complete what the launcher does not say, then check the numbers agree with each other.
xs_derive_layout() {
  local tasks_per_node
  if [[ -z $XS_LOCAL_WORLD_SIZE && $XS_LAUNCHER == slurm ]] \
      && xs_first_set tasks_per_node SLURM_STEP_TASKS_PER_NODE,SLURM_TASKS_PER_NODE; then
    xs_tasks_on_node XS_LOCAL_WORLD_SIZE "${XS_NODE_RANK:-0}" "$tasks_per_node"
    XS_SAID[LOCAL_WORLD_SIZE]=$XS_SOURCE_VAR
  fi
  : "${XS_LOCAL_RANK:=$XS_RANK}" "${XS_LOCAL_WORLD_SIZE:=$XS_WORLD_SIZE}"
  (( XS_LOCAL_WORLD_SIZE > 0 )) || xs_die "local world size is 0 (launcher: $XS_LAUNCHER)"
  # MPI launchers do not number nodes; with the usual block placement, rank / ranks-per-node does.
  : "${XS_NODE_RANK:=$((XS_RANK / XS_LOCAL_WORLD_SIZE))}"
  if [[ -z $XS_NNODES && $XS_LAUNCHER == pbs && -r ${PBS_NODEFILE:-} ]]; then
    xs_count_pbs_nodes XS_NNODES
    XS_SAID[NNODES]=PBS_NODEFILE
  fi
  : "${XS_NNODES:=$(((XS_WORLD_SIZE + XS_LOCAL_WORLD_SIZE - 1) / XS_LOCAL_WORLD_SIZE))}"
  xs_replacement_layout
  (( XS_RANK < XS_WORLD_SIZE )) \
    || xs_die "rank $XS_RANK is not below world size $XS_WORLD_SIZE (launcher: $XS_LAUNCHER)"
  (( XS_LOCAL_RANK < XS_LOCAL_WORLD_SIZE )) \
    || xs_die "local rank $XS_LOCAL_RANK is not below local world size $XS_LOCAL_WORLD_SIZE (launcher: $XS_LAUNCHER)"
}

# A step that live recovery launched on a spare node (jobs/lib/coordinator.py) stands in for node
# NODE_RANK of NNODES of the training (XSCALE_REPLACEMENT=NODE_RANK/NNODES): its ranks take that
# node's numbers in the training's world, not their own step's. A rank started again on its own
# node is a step of one task that stands in for local rank LOCAL_RANK of PER_NODE there
# (NODE_RANK/NNODES:LOCAL_RANK/PER_NODE): its GPUs and CPU share are that rank's.
xs_replacement_layout() {
  local given=${XSCALE_REPLACEMENT:-} name
  [[ -n $given ]] || return 0
  [[ $given =~ ^([0-9]{1,6})/([0-9]{1,6})(:([0-9]{1,4})/([0-9]{1,4}))?$ ]] \
    || xs_die "XSCALE_REPLACEMENT='$given' is not NODE_RANK/NNODES or NODE_RANK/NNODES:LOCAL_RANK/PER_NODE"
  XS_NODE_RANK=$((10#${BASH_REMATCH[1]})) XS_NNODES=$((10#${BASH_REMATCH[2]}))
  (( XS_NODE_RANK < XS_NNODES )) || xs_die "XSCALE_REPLACEMENT='$given': no node $XS_NODE_RANK of $XS_NNODES"
  if [[ -n ${BASH_REMATCH[3]} ]]; then
    (( XS_LOCAL_WORLD_SIZE == 1 )) \
      || xs_die "XSCALE_REPLACEMENT='$given' names one rank, but this step has $XS_LOCAL_WORLD_SIZE on the node"
    XS_LOCAL_RANK=$((10#${BASH_REMATCH[4]})) XS_LOCAL_WORLD_SIZE=$((10#${BASH_REMATCH[5]}))
    XS_SAID[LOCAL_RANK]=XSCALE_REPLACEMENT XS_SAID[LOCAL_WORLD_SIZE]=XSCALE_REPLACEMENT
  fi
  XS_RANK=$((XS_NODE_RANK * XS_LOCAL_WORLD_SIZE + XS_LOCAL_RANK))
  XS_WORLD_SIZE=$((XS_NNODES * XS_LOCAL_WORLD_SIZE))
  for name in RANK WORLD_SIZE NODE_RANK NNODES; do
    XS_SAID[$name]=XSCALE_REPLACEMENT
  done
}

xs_count_pbs_nodes() {
  local line
  local -A seen=()
  while IFS= read -r line; do
    [[ -n $line ]] && seen[$line]=1
  done <"$PBS_NODEFILE"
  printf -v "$1" '%d' "${#seen[@]}"
}

# Exported under torchrun's names. A rank variable set before run.sh must agree with what the
# launcher says: a job script's stale `export WORLD_SIZE=16` in a 4-rank step would leave every
# rank waiting in the rendezvous until torch's timeout. A value the launcher does not say (MPI's
# node rank, guessed from block placement) is the user's to set.
xs_export_layout() {
  local name value source
  for name in "${XS_LAYOUT_NAMES[@]}"; do
    value=XS_$name
    value=${!value} source=${XS_SAID[$name]:-$name}
    if [[ -v $name && $source != "$name" ]] && ! xs_same_number "${!name}" "$value"; then
      xs_die "$name=${!name} was set before run.sh, but $XS_LAUNCHER says $value ($source);" \
        "unset $name and run.sh exports the launcher's"
    fi
    xs_default "$name" "$value"
  done
}

# True when A is a whole number equal to B (so that 04 and 4 agree).
xs_same_number() {
  [[ $1 =~ ^[0-9]{1,9}$ ]] && (( 10#$1 == $2 ))
}

