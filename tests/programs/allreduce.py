"""The smallest real DDP check: every rank joins a gloo group from run.sh's variables alone,
all-reduces rank+1, and prints what it saw as one `XSCALE_CHECK {json}` line.

`--announce FILE --hold-until FILE` keep the group (and so MASTER_PORT) open until another job
has announced itself: two jobs on one node then provably ran at the same time.

It also reports what tells the virtual nodes apart (docs/TESTBED.md): the host name, each
interface's IPv4 address, the interface the kernel routes MASTER_ADDR through, and, with
`--mark-tmp`, which ranks' marker files this rank finds in its /tmp after all have written one.
"""

import argparse
import fcntl
import json
import os
import socket
import struct
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address


def hold(announce: Path | None, until: Path | None, timeout_s: float = 120) -> None:
    """Announce that our rendezvous is up, then wait (bounded) for the other job's announcement."""
    if announce:
        announce.write_text(os.environ["MASTER_PORT"])
    deadline = time.monotonic() + timeout_s
    while until and not until.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"allreduce: error: {until} did not appear within {timeout_s}s")
        time.sleep(0.05)


def ipv4_addresses() -> dict[str, str]:
    """{interface: IPv4 address} for every interface that has one."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, request)
            except OSError:  # no IPv4 address on this interface
                continue
            found[name] = socket.inet_ntoa(reply[20:24])
    return found


def route_to(host: str, port: int, addresses: dict[str, str]) -> dict[str, str]:
    """The local address (and its interface) this node uses to reach host: connecting a UDP
    socket asks the kernel's routing table and sends nothing."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((host, port))
        local = sock.getsockname()[0]
    interface = next((name for name, addr in addresses.items() if addr == local), "?")
    return {"to": socket.gethostbyname(host), "from": local, "interface": interface}


def tmp_marks(rank: int) -> list[int]:
    """Write this rank's marker into /tmp, wait for every rank to do the same, and return the
    ranks whose markers this rank can see: its own node's ranks on separate nodes."""
    step = f"{os.environ.get('SLURM_JOB_ID', 'nojob')}.{os.environ.get('SLURM_STEP_ID', 0)}"
    tag = f"xscale-mark-{step}"
    Path(f"/tmp/{tag}-{rank}").touch()
    dist.barrier()
    return sorted(int(p.name.rsplit("-", 1)[1]) for p in Path("/tmp").glob(f"{tag}-*"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--announce", type=Path)
    parser.add_argument("--hold-until", type=Path)
    parser.add_argument("--mark-tmp", action="store_true")
    args, _ = parser.parse_known_args()
    dist.init_process_group("gloo")  # env:// from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    value = torch.tensor([rank + 1.0])
    dist.all_reduce(value)
    record = {
        "rank": rank,
        "world_size": world,
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "node_rank": int(os.environ["NODE_RANK"]),
        "nnodes": int(os.environ["NNODES"]),
        "node": os.environ.get("SLURMD_NODENAME", socket.gethostname()),
        "sum": value.item(),
        "expected": world * (world + 1) / 2,
        "omp_threads": os.environ.get("OMP_NUM_THREADS"),
        "profiled": os.environ.get("XSCALE_PROFILED") == "1",
        "master": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        "argv": sys.argv[1:],
        "cache_dir": os.environ.get("XSCALE_CACHE_DIR"),
        "hostname": socket.gethostname(),
        "socket_ifname": {"nccl": os.environ.get("NCCL_SOCKET_IFNAME"),
                          "gloo": os.environ.get("GLOO_SOCKET_IFNAME")},
    }
    addresses = ipv4_addresses()
    record["addresses"] = addresses
    record["route_to_master"] = route_to(os.environ["MASTER_ADDR"],
                                         int(os.environ["MASTER_PORT"]), addresses)
    if args.mark_tmp:
        record["tmp_marks"] = tmp_marks(rank)
    print("XSCALE_CHECK " + json.dumps(record), flush=True)
    if rank == 0:
        hold(args.announce, args.hold_until)
    dist.barrier()
    dist.destroy_process_group()
    # gloo can abort at interpreter exit after a finished run (pytorch/pytorch issue 190489;
    # docs/ARCHITECTURE.md): leave at once.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
