# shellcheck shell=bash
# Site profile: NVIDIA GPU clusters (InfiniBand or RoCE, NCCL).
#
# Sourced by runscripts/lib/site.sh once per rank. Defaults only; no forks, no output.
#
# Deliberately forces no NCCL_* variable. On InfiniBand clusters NCCL finds the HCAs, the
# GPU-NIC PCI topology, the GPU Direct RDMA level and the bootstrap interface by itself, and
# NCCL's documentation treats its environment variables as tuning and debugging knobs, not
# required settings; a value copied from another machine (NCCL_SOCKET_IFNAME=ib0,
# NCCL_IB_HCA=mlx5_0, NCCL_NET_GDR_LEVEL) is a common cause of hangs or slow runs on the next
# one. NCCL_DEBUG stays unset so NCCL only prints warnings; set NCCL_DEBUG=INFO yourself to see
# which transport it picked. Site admins usually put cluster-wide values in /etc/nccl.conf.

# shellcheck disable=SC2034  # read by lib/binding.sh after sourcing (GPU visibility variables)
XS_GPU_VENDOR=nvidia
# shellcheck disable=SC2034  # read by lib/profiling.sh; {dir}/rank{rank} is created before exec
XS_PROFILER_DEFAULT='nsys profile -t cuda,nvtx -o {dir}/rank{rank}'
