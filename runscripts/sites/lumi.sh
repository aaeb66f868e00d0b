# shellcheck shell=bash
# Site profile: LUMI-G (AMD MI250X, 8 GCDs per node, HPE Slingshot-11, Lustre).
#
# Sourced by runscripts/lib/site.sh once per rank. Defaults only: every line goes through
# xs_default, so a variable the user already exported wins. No forks, no output.

# shellcheck disable=SC2034  # read by lib/binding.sh after sourcing (GPU visibility variables)
XS_GPU_VENDOR=amd
# shellcheck disable=SC2034  # read by lib/profiling.sh; {dir}/rank{rank} is created before exec
XS_PROFILER_DEFAULT='rocprof --hip-trace --stats -o {dir}/rank{rank}/results.csv'

# --- RCCL: which network interfaces -------------------------------------------------------------
# Without this RCCL may bootstrap over the node-management interface (nmn0), which it cannot use
# between nodes, and inter-node communication fails or crawls. The four hsn* devices are the
# Slingshot NICs, one per MI250X. Source: LUMI AI workshop, "Extreme scale AI"; LUMI PyTorch
# container docs (conda-python-distributed runscript). LUMI's PyTorch EasyBuild notes add that on
# current ROCm the prefix form NCCL_SOCKET_IFNAME=hsn works as well.
xs_default NCCL_SOCKET_IFNAME hsn0,hsn1,hsn2,hsn3

# --- RCCL: GPU Direct RDMA level (set only where RCCL needs it) -------------------------------
# The older LUMI material forced NCCL_NET_GDR_LEVEL=PHB (AI workshop) or 3 (PyTorch container
# runscripts) so RCCL would use GPU RDMA to the NIC. Since ROCm 6.2 PHB is RCCL's default
# (LUMI-AI-example, "RCCL environment variables"), and with the ROCm 7.0 containers a forced PHB
# or SYS makes multi-node torch.distributed jobs hang in init (lumi-ai-factory/
# laifs-container-recipes issue 30, reported from issue 28); the LUMI AI Guide dropped it in its
# ROCm 7.0 update (LUMI-AI-Guide PR 97) with no loss of bandwidth. Images older than ROCm 6.2
# (LUMI's DeepSpeed image lumi-pytorch-rocm-6.1.3-...-pytorch-v2.4.1, used in the AI workshop's
# DeepSpeed exercise) do not default to PHB, so there we set it as the workshop does. The image's
# release comes from ROCm's own version file (xs_rocm_older_than). XSCALE_NCCL_NET_GDR_LEVEL
# forces a level on any image; an exported NCCL_NET_GDR_LEVEL wins over both.
if [[ -n ${XSCALE_NCCL_NET_GDR_LEVEL:-} ]]; then
  xs_default NCCL_NET_GDR_LEVEL "$XSCALE_NCCL_NET_GDR_LEVEL"
elif xs_rocm_older_than 6 2; then
  xs_default NCCL_NET_GDR_LEVEL PHB
fi

# --- libfabric CXI provider (used by RCCL's aws-ofi-rccl plugin) --------------------------------
# PyTorch DataLoader workers are fork()ed after RCCL has registered memory with the NIC. Like
# libibverbs' RDMAV_FORK_SAFE, these make libcxi mark registered pages (and huge pages) as not
# inherited, so a child does not corrupt or steal the parent's pinned buffers; completion queues
# are kept off hugetlbfs for the same reason. Source: LUMI ml-examples (hvd/README), which lists
# the CXI_* variables and FI_CXI_DISABLE_CQ_HUGETLB as needed by RCCL over Slingshot.
xs_default CXI_FORK_SAFE 1
xs_default CXI_FORK_SAFE_HP 1
xs_default FI_CXI_DISABLE_CQ_HUGETLB 1
# A larger completion queue avoids "Cassini Event Queue overflow detected" aborts when eight
# ranks per node run all-reduces with many small messages. The value 131072 is the one used in
# AMD's LUMI launch scripts and LUMI user job scripts, and in the Isambard-AI NCCL-on-Slingshot
# guide.
xs_default FI_CXI_DEFAULT_CQ_SIZE 131072

# --- MIOpen caches on node-local /tmp -----------------------------------------------------------
# MIOpen keeps its kernel database in SQLite files under $HOME by default; on Lustre the file
# locking SQLite needs does not work and many ranks racing for one file corrupt or stall it.
# XSCALE_CACHE_DIR is per user, job, step and node, under node-local /tmp. Source: LUMI AI
# workshop, "Extreme scale AI"; LUMI PyTorch container docs (conda-python-distributed).
xs_default MIOPEN_USER_DB_PATH "$XSCALE_CACHE_DIR/miopen"
xs_default MIOPEN_CUSTOM_CACHE_DIR "$XSCALE_CACHE_DIR/miopen"

# --- What the preflight doctor expects (runscripts/doctor; plain variables, not exported) -------
# RCCL reaches Slingshot only through the aws-ofi-rccl plugin, which RCCL loads by this name
# (ROCm/aws-ofi-rccl); without it RCCL says "Using network Socket" and runs over TCP.
# shellcheck disable=SC2034  # read by runscripts/doctor
XS_NET_PLUGIN_LIBS=librccl-net.so
# A floor, not a measurement: LUMI-G has four 200 Gb/s Slingshot-11 NICs per node, 25 GB/s each
# way (LUMI documentation, "Network and interconnect"); a 64 MiB all-reduce between nodes that
# reaches a fifth of that is healthy, while the TCP fallback stays at a few GB/s.
# shellcheck disable=SC2034  # read by runscripts/doctor
XS_MIN_BUSBW_GBPS=20
