# shellcheck shell=bash
# Site profile: NVIDIA GPUs on an HPE Slingshot 11 network (ALCF Polaris, CSCS Alps, Isambard-AI),
# chosen when /dev/nvidiactl and a CXI NIC are both present, or by XSCALE_SITE=nvidia-slingshot.
#
# Sourced by runscripts/lib/site.sh once per rank. Defaults only: every line goes through
# xs_default, so a variable the user (or a site module such as Isambard's brics/nccl) already
# exported wins. No forks, no output.
#
# Slingshot is not InfiniBand: NCCL reaches it only through the aws-ofi-nccl plugin (libfabric's
# CXI provider), which must be in the image or bound in from the host. Without these settings
# NCCL silently falls back to TCP sockets, 2-3x slower or worse. Each value below is one that all
# three sites document, except NCCL_SOCKET_IFNAME (Isambard-AI's; the others leave NCCL to find the
# interface); values the sites disagree on are left out (runscripts/sites/README.md):
#   ALCF Polaris  docs/polaris/applications-and-libraries/libraries/nccl.md (argonne-lcf/user-guides)
#   CSCS Alps     docs.cscs.ch, "NCCL" (eth-cscs/cscs-docs, docs/software/communication/nccl.md)
#   Isambard-AI   docs.isambard.ac.uk/user-documentation/guides/nccl/ (env_vars.sh)

# shellcheck disable=SC2034  # read by lib/binding.sh after sourcing (GPU visibility variables)
XS_GPU_VENDOR=nvidia
# shellcheck disable=SC2034  # read by lib/profiling.sh; {dir}/rank{rank} is created before exec
XS_PROFILER_DEFAULT='nsys profile -t cuda,nvtx -o {dir}/rank{rank}'

# --- NCCL: the libfabric plugin, and how to use it ------------------------------------------------
# Name the plugin's network so that NCCL fails at start-up when the plugin is missing instead of
# falling back to sockets (CSCS gives that reason).
xs_default NCCL_NET "AWS Libfabric"
# For the preflight doctor: aws-ofi-nccl installs itself as libnccl-net-ofi.so, with
# libnccl-net.so beside it in older releases (aws/aws-ofi-nccl, INSTALL.md).
# shellcheck disable=SC2034  # read by runscripts/doctor
XS_NET_PLUGIN_LIBS="libnccl-net-ofi.so libnccl-net.so"
# Bootstrap over the Slingshot interfaces (hsn0, hsn1, ...), not the management network
# (Isambard-AI; the same prefix LUMI uses for its hsn NICs).
xs_default NCCL_SOCKET_IFNAME hsn
# GPU Direct RDMA when GPU and NIC share a NUMA node, and rings/trees that may cross NICs: the
# Slingshot topology is not rail-optimised.
xs_default NCCL_NET_GDR_LEVEL PHB
xs_default NCCL_CROSS_NIC 1

# --- libfabric CXI provider ------------------------------------------------------------------------
# The memory-registration cache monitor and host-memory registration: the pair the sites give
# against NCCL hangs and deadlocks with CUDA allocations; a larger completion queue against
# "Cassini Event Queue overflow" with several GPUs per node.
xs_default FI_MR_CACHE_MONITOR userfaultfd
xs_default FI_CXI_DISABLE_HOST_REGISTER 1
xs_default FI_CXI_DEFAULT_CQ_SIZE 131072
