# shellcheck shell=bash
# Site profile: ALCF Aurora (Intel Data Center GPU Max 1550, 6 GPUs x 2 tiles per node, HPE
# Slingshot-11, PBS + PALS mpiexec, PyTorch DDP over oneCCL).
#
# Sourced by runscripts/lib/site.sh once per rank. Defaults only: every line goes through
# xs_default, so a variable the user (or `module load frameworks_optimized`) already exported
# wins. No forks, no output. Unless noted, values are ALCF's "oneCCL environment variables" list
# on the Aurora oneCCL page, the settings ALCF ships in the frameworks_optimized module and
# recommends from 16 nodes up (ALCF "PyTorch on Aurora", "Settings for training beyond 16 nodes").

# shellcheck disable=SC2034  # read by lib/binding.sh after sourcing (GPU visibility variables)
XS_GPU_VENDOR=intel
# unitrace (pti-gpu module, loaded by `module load frameworks`) is the profiler ALCF documents for
# deep-learning jobs ("Profiling Deep Learning Applications"): device kernels plus oneCCL calls,
# as Perfetto-readable JSON.
# shellcheck disable=SC2034  # read by lib/profiling.sh; {dir}/rank{rank} is created before exec
XS_PROFILER_DEFAULT='unitrace --chrome-device-logging --chrome-ccl-logging --output-dir-path {dir}/rank{rank}'

# --- GPU tiles as devices -----------------------------------------------------------------------
# FLAT exposes each tile as its own device (12 per node), which is what one rank per tile and
# ZE_AFFINITY_MASK=<local rank> assume. It is the driver default today; pinning it keeps a user's
# COMPOSITE setting from another job out of the way. Source: ALCF "PyTorch on Aurora".
xs_default ZE_FLAT_DEVICE_HIERARCHY FLAT

# --- oneCCL bootstrap -----------------------------------------------------------------------------
# Aurora's MPICH runs under PALS with PMIx; oneCCL must use the same launcher interface and
# exchange its addresses over MPI rather than its own TCP key-value store, which is slow and
# times out at scale. The 600 s connection timeout lets thousands of ranks finish start-up.
xs_default CCL_PROCESS_LAUNCHER pmix
xs_default CCL_ATL_TRANSPORT mpi
xs_default CCL_KVS_MODE mpi
xs_default CCL_KVS_USE_MPI_RANKS 1
xs_default CCL_KVS_CONNECTION_TIMEOUT 600
# GPU buffers with SYCL kernels; an empty CCL_CONFIGURATION_PATH stops oneCCL from loading a
# configuration file that does not match this one.
xs_default CCL_CONFIGURATION cpu_gpu_dpcpp
xs_default CCL_CONFIGURATION_PATH ""
# Keep more Level Zero IPC handles open between tiles of a node instead of reopening them.
xs_default CCL_ZE_CACHE_OPEN_IPC_HANDLES_THRESHOLD 1024

# --- oneCCL algorithms ----------------------------------------------------------------------------
# ALCF's measured best at scale: direct all-reduce across nodes for messages up to 1 MiB,
# Rabenseifner above; double-tree broadcast.
xs_default CCL_ALLREDUCE_SCALEOUT 'direct:0-1048576;rabenseifner:1048577-max'
xs_default CCL_BCAST double_tree
# Synchronous collectives and ops: ALCF lists these "to avoid potential hang at large scale".
xs_default CCL_ATL_SYNC_COLL 1
xs_default CCL_OP_SYNC 1

# --- libfabric / Slingshot ------------------------------------------------------------------------
# CXI is the Slingshot provider; oneCCL's MPI transport must use the same one as MPICH.
xs_default FI_PROVIDER cxi
xs_default MPI_PROVIDER "$FI_PROVIDER"
# Bigger completion queue and overflow buffers, hybrid (hardware, then software) tag matching and
# the queue fill level at which CXI reports saturation: headroom for 12 ranks per node posting
# collectives at once (oneCCL page, the list ALCF calls application-dependent).
xs_default FI_CXI_DEFAULT_CQ_SIZE 1048576
xs_default FI_CXI_OFLOW_BUF_SIZE 8388608
xs_default FI_CXI_CQ_FILL_PERCENT 30
xs_default FI_CXI_RX_MATCH_MODE hybrid
# The memory-registration cache monitor: userfaultfd, as in ALCF's "minimal set" (the settings it
# calls essential for training and tested up to 1024 nodes); `disabled` is only in its
# application-dependent list. Source: ALCF user guide, Aurora "oneCCL" page (argonne-lcf/
# user-guides, docs/aurora/data-science/frameworks/oneCCL.md). The Level Zero monitor stays off,
# as in that page's application-dependent list like the FI_CXI_* values above.
xs_default FI_MR_CACHE_MONITOR userfaultfd
xs_default FI_MR_ZE_CACHE_MONITOR_ENABLED 0
