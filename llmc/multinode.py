"""
llmc/multinode.py: starting data parallelism on one node or many, as llm.c's llmc/zero.cuh does
(multi_gpu_config_init): every process learns its rank, the number of processes and its GPU, and
all of them join one NCCL communicator. NCCL needs one 128-byte "unique id", made by rank 0 and
handed to every other process before they can talk; -pm says how it travels:

    mpi  MPI broadcasts it (mpiexec / mpirun; llmc.comm, the default)
    tcp  rank 0 listens on port --rendezvous-port of its node, -ps HOST, and sends it to the N-1 others
    fs   rank 0 writes it to a file in the shared directory -pp DIR, the others read it

tcp and fs exist because on many clusters MPI cannot start the job (newer Slurm packages ship
without PMIx): srun starts the processes and each learns its rank from Slurm's environment.
NCCL stays the distributed engine; this module only starts it. What it deliberately is not: a
transport of our own. Without MPI, the host-side reductions (the loss, the gradient norm, the
validation loss, HellaSwag counts, the checkpoint barrier) go through NCCL too, as an all-reduce
of a few float64s in a device buffer (ProcessGroup.mean_).

"One rank fails, all stop": under MPI that is MPI_Abort (llmc.comm.abort_all_ranks). With tcp or
fs the rendezvous channel stays open as a stop line: a failing rank sends a stop notice (tcp: a
message to rank 0, which passes it on; fs: an `.abort` file every rank polls), and a rank whose
tcp connection drops without a goodbye (killed, crashed, node lost: TCP keepalive) stops everyone
too. A stopping rank aborts its NCCL communicator and exits at once with the failing rank's code.

Check a cluster's rendezvous before a long job (no GPU needed; rank 0 sends 128 random bytes and
every rank prints their SHA-256, which must agree):
    srun -N 2 --ntasks-per-node=8 python -m llmc.multinode -pm tcp -ps node1
    python -m llmc.multinode -pm fs -pn 2 -pr 0 -pp /tmp -pj test & python -m llmc.multinode -pm fs -pn 2 -pr 1 -pp /tmp -pj test
prints `rank 0/2 (fs): id sha256 <64 hex digits>, GPU 0 of <host>` once per rank.
"""

import atexit
import hashlib
import json
import math
import os
import secrets
import select
import socket
import struct
import sys
import threading
import time

import numpy as np

from llmc import comm as llmc_comm
from llmc import cuda
from llmc.argparser import ArgumentParser
from llmc.launcher import launcher_environment
from llmc.utils import InputError

METHODS = ("mpi", "tcp", "fs")
DEFAULT_METHOD = "mpi"                 # llm.c's default -pm
DEFAULT_GPUS_PER_NODE = 8              # llm.c's default -pg
DEFAULT_SERVER = "127.0.0.1"           # -ps: one node; on several, the address of rank 0's node
DEFAULT_FS_PATH = "/tmp"               # llm.c's default -pp (a shared directory on several nodes)
DEFAULT_PORT = 12345                   # the port llm.c hard-codes for its tcp exchange
DEFAULT_TIMEOUT = 300.0                # seconds the rendezvous waits for every process
NCCL_UNIQUE_ID_BYTES = 128             # sizeof(ncclUniqueId), nccl.h

# tcp: the messages, each a one-byte kind and a length-prefixed body (struct "!I")
HELLO_MAGIC = b"LLMC"                  # a connection not starting with this is not one of our ranks
MSG_HELLO, MSG_ID, MSG_ERROR, MSG_STOP, MSG_BYE = b"H", b"I", b"E", b"S", b"B"
MAX_MESSAGE_BYTES = 1 << 16           # a longer one is not from one of our ranks
HELLO_SECONDS = 10.0                   # a connection must say who it is within this
RETRY_SECONDS = 0.2                    # between connection attempts / file polls in the rendezvous
FS_POLL_SECONDS = 0.05
STOP_POLL_SECONDS = 1.0                # fs: how often each rank looks for the stop file
KEEPALIVE = {"TCP_KEEPIDLE": 60, "TCP_KEEPINTVL": 10, "TCP_KEEPCNT": 6}   # a lost node is noticed in ~2 min

class RendezvousError(InputError):
    """The processes could not meet: one `error:` line (a peer that never arrived, a duplicate
    rank, a port in use, a stale file...), exit 1."""


# ----------------------------------------------------------------------------
# the flags (llm.c's -p letters; help in llm.c's words where it has them)

def add_flags(parser):
    """Add the process-group flags to an argparse parser, in their own group."""
    a = parser.add_argument_group("processes (llm.c's -p flags; llmc/multinode.py)").add_argument
    a("-pm", "--init-method", default=DEFAULT_METHOD, choices=METHODS,
      help="nccl_init_method: how the NCCL id reaches every process: mpi (mpiexec), tcp (rank 0 serves it "
           "on -ps), fs (a file in the shared directory -pp)")
    a("-pn", "--num-processes", type=int, default=None,
      help="num_processes (tcp, fs; None: the launcher's SLURM_NTASKS / PMI_SIZE / OMPI_COMM_WORLD_SIZE, else 1)")
    a("-pr", "--process-rank", type=int, default=None,
      help="process_rank (tcp, fs; None: the launcher's SLURM_PROCID / PMI_RANK / OMPI_COMM_WORLD_RANK, else 0)")
    a("-pg", "--gpus-per-node", type=int, default=DEFAULT_GPUS_PER_NODE,
      help="gpus_per_node: a process without a launcher's local rank uses GPU process_rank %% gpus_per_node")
    a("-ps", "--server-ip", default=DEFAULT_SERVER,
      help="server_ip, used only with -pm tcp: the address of the node running rank 0")
    a("-pp", "--fs-path", default=DEFAULT_FS_PATH,
      help="fs_path, used only with -pm fs: a directory every node sees (shared file system)")
    a("-pj", "--job-id", default=None,
      help="names the -pm fs files, so a file of an earlier job is never read (None: $SLURM_JOB_ID)")
    a("--rendezvous-port", type=int, default=DEFAULT_PORT, help="the port rank 0 listens on with -pm tcp")
    a("--rendezvous-timeout", type=float, default=DEFAULT_TIMEOUT,
      help="seconds the tcp/fs rendezvous waits for every process before giving up")
    return parser


# ----------------------------------------------------------------------------
# who am I: rank, size and local rank from the flags and the launcher's environment (llmc.launcher)

def job_name(job_id, env=os.environ):
    """The name of this job's -pm fs files: -pj, else $SLURM_JOB_ID (with $SLURM_RESTART_COUNT
    when Slurm requeued the job, whose id does not change), else None."""
    if job_id:
        return str(job_id)
    if env.get("SLURM_JOB_ID"):
        restarts = env.get("SLURM_RESTART_COUNT")
        return env["SLURM_JOB_ID"] + (f".{restarts}" if restarts else "")
    return None


class Placement:
    """Where this process runs: method, rank, size, local rank (its GPU among this node's, before
    CUDA_VISIBLE_DEVICES), host name, and the tcp/fs rendezvous settings."""

    def __init__(self, method, rank, size, local_rank, host, server="", port=DEFAULT_PORT, fs_path="",
                 job="", timeout=DEFAULT_TIMEOUT, local_source=""):
        self.method, self.rank, self.size, self.local_rank, self.host = method, rank, size, local_rank, host
        self.server, self.port, self.fs_path, self.job, self.timeout = server, port, fs_path, job, timeout
        self.local_source = local_source           # "SLURM_LOCALID", "-pr % -pg", ... for the banner


def resolve_placement(args, env=os.environ, host=None):
    """The Placement of this process from the flags (args: add_flags's) and the launcher's
    environment, for -pm tcp or fs (mpi asks MPI). Rank and size: -pr / -pn, else the launcher's,
    else 0 of 1. Local rank: the launcher's, else -pr % -pg. Raises InputError naming the flag."""
    launcher = launcher_environment(env)
    size = args.num_processes if args.num_processes is not None else (launcher[2] if launcher else 1)
    rank = args.process_rank if args.process_rank is not None else (launcher[1] if launcher else 0)
    if size < 1:
        raise InputError(f"-pn {size}: the number of processes must be >= 1")
    if not 0 <= rank < size:
        raise InputError(f"-pr {rank} is out of range for -pn {size} (ranks are 0..{size - 1})")
    if args.gpus_per_node < 1:
        raise InputError(f"-pg {args.gpus_per_node}: GPUs per node must be >= 1")
    if launcher and launcher[3] is not None and args.process_rank in (None, launcher[1]):
        local_rank, source = launcher[3], f"{launcher[0]}'s local rank"
    else:
        local_rank, source = rank % args.gpus_per_node, "-pr % -pg"
    if local_rank >= args.gpus_per_node:
        raise InputError(f"rank {rank} is local rank {local_rank} of its node but -pg is {args.gpus_per_node}: "
                         f"more processes on this node than GPUs")
    job = job_name(args.job_id, env)
    if job is not None and (os.sep in job or job in (".", "..")):
        raise InputError(f"-pj {job}: a job id names files: no '{os.sep}', and not '.' or '..'")
    if args.init_method == "fs" and size > 1:
        if job is None:
            raise InputError("-pm fs needs a job id to name its files (-pj ID, or $SLURM_JOB_ID under Slurm), "
                             "so that a file left by an earlier job is never read")
        if not os.path.isdir(args.fs_path):
            raise InputError(f"-pp {args.fs_path}: not a directory")
        if not writable_directory(args.fs_path):
            raise InputError(f"-pp {args.fs_path}: not a directory this process can write (every rank writes its "
                             f"rendezvous file there)")
    if not 0 < args.rendezvous_port < 65536:
        raise InputError(f"--rendezvous-port {args.rendezvous_port}: not a port number")
    if not (args.rendezvous_timeout > 0 and math.isfinite(args.rendezvous_timeout)):
        raise InputError(f"--rendezvous-timeout {args.rendezvous_timeout}: must be a finite number of seconds > 0 "
                         f"(a lost process must not be waited for forever)")
    return Placement(args.init_method, rank, size, local_rank, host or socket.gethostname(), args.server_ip,
                     args.rendezvous_port, args.fs_path, job, args.rendezvous_timeout, source)


# the agreement's entry holding the one line this rank would stop with alone (llmc.cli.start_problem)
PROBLEM_KEY = "problem"


def disagreement(agreements):
    """agreements: {rank: what decides that rank's part of the result} (a dict of flags and file
    fingerprints: llmc.cli.agreement_config), rank 0's included. None when every rank's is rank
    0's; else one line. A rank that cannot start at all (its PROBLEM_KEY: a missing -i, ...) is
    named with its problem, which matters more than the differences it causes; a problem every
    rank has is said once, as one process would say it. Otherwise the line names every key that
    differs. Values are compared as JSON, so that one sent through the rendezvous (tuples become
    lists) equals the same value at home, and NaN equals NaN."""
    problems = {rank: config.get(PROBLEM_KEY) for rank, config in sorted(agreements.items()) if config.get(PROBLEM_KEY)}
    if problems:
        first = next(iter(problems.values()))
        alike = [rank for rank, problem in problems.items() if problem == first]
        if len(alike) == len(agreements):
            return first
        who = f"rank {alike[0]}" if len(alike) == 1 else f"ranks {', '.join(map(str, alike))}"
        return f"{who} cannot start: {first}"
    as_json = {rank: {key: json.dumps(value, sort_keys=True) for key, value in config.items()}
               for rank, config in agreements.items()}
    reference = as_json[0]
    differing = sorted({key for config in as_json.values() for key in set(config) | set(reference)
                        if config.get(key) != reference.get(key)})
    if not differing:
        return None
    first = min(rank for rank, config in as_json.items() if config != reference)
    return (f"the ranks of this job were started with different {', '.join(differing)} (rank {first} differs "
            f"from rank 0): start every rank with the same flags and files")


def writable_directory(path):
    """Whether this process can create a file in directory `path`: by trying, since permission
    bits do not tell (root ignores them; a read-only mount or /proc refuses whatever they say)."""
    probe = os.path.join(path, f".llmc_write_probe.{os.getpid()}")
    try:
        with open(probe, "x"):
            pass
        os.remove(probe)
        return True
    except OSError:
        return False


def check_distinct_gpus(placements):
    """placements: (rank, host, local rank) of every process. Raises RendezvousError when two
    processes would share one GPU (the same local rank on the same host)."""
    seen = {}
    for rank, host, local_rank in placements:
        other = seen.setdefault((host, local_rank), rank)
        if other != rank:
            raise RendezvousError(f"ranks {other} and {rank} would share GPU {local_rank} of {host}: "
                                  f"one process per GPU (check -pr, -pg and the launcher's tasks per node)")


# ----------------------------------------------------------------------------
# tcp: rank 0 serves the id; the connections stay open as the stop line

def send_message(sock, kind, body=b""):
    """One message: a kind byte, the body's length (4 bytes, network order), the body."""
    sock.sendall(kind + struct.pack("!I", len(body)) + body)


def receive_exactly(sock, n):
    """n bytes from sock, or fewer if the peer closed the connection first."""
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def receive_message(sock):
    """(kind, body) of the next message; (None, b"") when the connection closed, or the message is
    cut short or longer than MAX_MESSAGE_BYTES."""
    head = receive_exactly(sock, 5)
    if len(head) < 5:
        return None, b""
    (length,) = struct.unpack("!I", head[1:])
    if length > MAX_MESSAGE_BYTES:
        return None, b""
    body = receive_exactly(sock, length)
    return (head[:1], body) if len(body) == length else (None, b"")


def keep_alive(sock):
    """TCP keepalive, so that a peer on a node that vanished is noticed within ~2 minutes."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in KEEPALIVE.items():
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def tcp_serve_id(unique_id, p, agreement=None):
    """Rank 0: listen on p.port (every interface of this node, so that -ps may be any of its names
    or addresses: a host name can resolve to a loopback address on its own node), accept the N-1
    other ranks (each says its rank, -pn, host, local rank and its agreement: see disagreement),
    check them, send each the id. Returns {rank: socket}, kept open.
    Raises RendezvousError (having told every connected rank) for a port in use, a rank that never
    arrives within p.timeout, a rank out of range, one rank claimed twice, two ranks on one GPU, or
    ranks whose agreement differs from rank 0's."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # not SO_REUSEPORT: a busy port must fail
    try:
        server.bind(("", p.port))
        server.listen(p.size)
    except OSError as e:
        server.close()
        raise RendezvousError(f"rank 0 cannot listen on port {p.port} of {p.host} ({e.strerror or e}): another job "
                              f"may hold it (pass another --rendezvous-port)") from None
    peers, placements, agreements = {}, [(0, p.host, p.local_rank)], {0: agreement}
    deadline = time.monotonic() + p.timeout
    newcomer = None                            # the connection being checked, not yet in peers
    try:
        while len(peers) < p.size - 1:
            server.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                newcomer, _ = server.accept()
            except socket.timeout:
                missing = sorted(set(range(1, p.size)) - set(peers))
                raise RendezvousError(f"rank(s) {', '.join(map(str, missing))} never reached rank 0 at "
                                      f"{p.server}:{p.port} within {p.timeout:g} s") from None
            newcomer.settimeout(min(HELLO_SECONDS, max(deadline - time.monotonic(), 0.001)))
            hello = read_hello(newcomer)
            if hello is None:
                newcomer.close()               # not one of our ranks (a port scanner, a stale client)
                newcomer = None
                continue
            rank, size, host = hello["rank"], hello["size"], hello["host"]
            if size != p.size:
                raise RendezvousError(f"rank {rank} (on {host}) says -pn {size}, rank 0 says -pn {p.size}")
            if not 1 <= rank < p.size:
                raise RendezvousError(f"a process on {host} claims rank {rank}, out of range for -pn {p.size}")
            if rank in peers:
                raise RendezvousError(f"two processes claim rank {rank} (on {placement_host(placements, rank)} "
                                      f"and {host}): each -pr must be used once")
            placements.append((rank, host, hello["local_rank"]))
            agreements[rank] = hello.get("agreement")
            peers[rank], newcomer = newcomer, None
            peers[rank].settimeout(None)
            check_distinct_gpus(placements)
        if agreement is not None and disagreement(agreements):
            raise RendezvousError(disagreement(agreements))
    except RendezvousError as e:
        for conn in list(peers.values()) + ([newcomer] if newcomer is not None else []):
            try:
                send_message(conn, MSG_ERROR, str(e).encode())
                conn.close()
            except OSError:
                pass
        raise
    finally:
        server.close()
    for conn in peers.values():
        send_message(conn, MSG_ID, bytes(unique_id))
        keep_alive(conn)
    return peers


def read_hello(conn):
    """A rank's hello on a new connection: {"rank", "size", "host", "local_rank"}, or None for
    anything else (no answer in time, another protocol, a malformed body)."""
    try:
        kind, body = receive_message(conn)
        hello = json.loads(body[len(HELLO_MAGIC):]) if kind == MSG_HELLO and body.startswith(HELLO_MAGIC) else None
    except (OSError, ValueError):
        return None
    keys = {"rank": int, "size": int, "host": str, "local_rank": int}
    if not isinstance(hello, dict) or any(not isinstance(hello.get(k), t) for k, t in keys.items()):
        return None
    return hello


def placement_host(placements, rank):
    """The host of `rank` among (rank, host, local rank) placements."""
    return next(host for r, host, _ in placements if r == rank)


def tcp_receive_id(p, agreement=None):
    """Ranks 1..N-1: connect to rank 0 at p.server:p.port (retrying until p.timeout), say who we
    are (with our agreement, for rank 0 to compare), receive the id. Returns (id bytes, the open socket). Raises RendezvousError when rank 0
    cannot be reached or answers late, refuses us (saying why), or sends a short id."""
    deadline = time.monotonic() + p.timeout
    while True:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            sock.connect((p.server, p.port))
            break
        except OSError:
            sock.close()
            if time.monotonic() + RETRY_SECONDS > deadline:
                raise RendezvousError(f"rank {p.rank} could not reach rank 0 at {p.server}:{p.port} within "
                                      f"{p.timeout:g} s (is rank 0 running, and is -ps its node's address?)") from None
            time.sleep(RETRY_SECONDS)
    hello = {"rank": p.rank, "size": p.size, "host": p.host, "local_rank": p.local_rank, "agreement": agreement}
    try:
        send_message(sock, MSG_HELLO, HELLO_MAGIC + json.dumps(hello).encode())
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        kind, body = receive_message(sock)
    except socket.timeout:
        sock.close()
        raise RendezvousError(f"rank {p.rank}: rank 0 at {p.server}:{p.port} did not send the NCCL id within "
                              f"{p.timeout:g} s (a rank never arrived?)") from None
    except OSError as e:
        sock.close()
        raise RendezvousError(f"rank {p.rank}: the connection to rank 0 at {p.server}:{p.port} failed "
                              f"({e.strerror or e})") from None
    if kind == MSG_ERROR:
        sock.close()
        raise RendezvousError(f"rank 0 refused the rendezvous: {body.decode(errors='replace')}")
    if kind != MSG_ID or len(body) != NCCL_UNIQUE_ID_BYTES:
        sock.close()
        raise RendezvousError(f"rank {p.rank}: received {len(body)} of the {NCCL_UNIQUE_ID_BYTES} bytes of the "
                              f"NCCL id from {p.server}:{p.port}")
    sock.settimeout(None)
    keep_alive(sock)
    return body, sock


class TcpStopLine:
    """The tcp connections kept after the rendezvous (a star around rank 0) as the stop line.
    stop(code) tells the others this rank failed; goodbye() tells them it ended normally; a
    watcher thread calls on_stop(code, reason) when a stop notice arrives or a connection drops
    without a goodbye. Rank 0 passes a stop notice on to every other rank."""

    def __init__(self, rank, peers):
        self.rank, self.peers, self.lock, self.done = rank, dict(peers), threading.Lock(), False

    def send_all(self, kind, body=b"", skip=None):
        with self.lock:
            for rank, conn in self.peers.items():
                if rank != skip:
                    try:
                        send_message(conn, kind, body)
                    except OSError:
                        pass

    def stop(self, code):
        self.send_all(MSG_STOP, struct.pack("!ii", self.rank, code))

    def goodbye(self):
        if not self.done:
            self.done = True
            self.send_all(MSG_BYE)

    def watch(self, on_stop):
        """Start the daemon thread that waits on every connection."""
        def run():
            open_peers = dict(self.peers)
            while open_peers and not self.done:
                ready, _, _ = select.select(list(open_peers.values()), [], [], 1.0)
                for conn in ready:
                    rank = next(r for r, c in open_peers.items() if c is conn)
                    try:
                        kind, body = receive_message(conn)
                    except OSError:
                        kind = None
                    if kind == MSG_BYE:
                        del open_peers[rank]
                        continue
                    if kind == MSG_STOP:
                        failed, code = struct.unpack("!ii", body)
                        reason = f"rank {failed} failed (exit code {code})"
                    else:
                        failed, code = rank, 1
                        reason = f"lost the connection to rank {rank} without a goodbye (killed, or its node is gone)"
                    if self.done:
                        return
                    self.send_all(MSG_STOP, struct.pack("!ii", failed, code), skip=rank)   # rank 0 passes it on
                    on_stop(code, reason)
                    return
        threading.Thread(target=run, name="llmc-stop-line", daemon=True).start()


# ----------------------------------------------------------------------------
# fs: the id in a file of the shared directory, named by the job

def fs_names(p):
    """The job's files in p.fs_path: claim prefix (one `<prefix><rank>` per rank > 0), the id
    file, the stop file."""
    base = os.path.join(p.fs_path, f"llmc_{p.job}")
    return base + ".rank", base + ".id", base + ".abort"


def fs_serve_id(unique_id, p, agreement=None):
    """Rank 0: refuse a stale id file of this job name; wait until ranks 1..N-1 have claimed their
    rank (each a `<job>.rank<R>` file, holding that rank's agreement); check the claims (and the
    agreements against rank 0's: see disagreement); write the id file under a temporary name
    and rename it; wait until every rank has read it (its claim file gone), then remove it. On an
    error, the file carries the error instead, so the waiting ranks stop at once, and is removed
    likewise. Raises RendezvousError."""
    claim_prefix, id_path, stop_path = fs_names(p)
    if os.path.exists(id_path):
        raise RendezvousError(f"{id_path} exists: left by an earlier job named {p.job} (remove it, or pass another -pj)")
    if os.path.exists(stop_path):
        os.remove(stop_path)                   # an earlier run of this job name stopped; this one is new
    deadline = time.monotonic() + p.timeout
    claims, error = {}, None
    while error is None and len(claims) < p.size - 1:
        for rank in range(1, p.size):
            if rank not in claims and os.path.exists(f"{claim_prefix}{rank}"):
                claim = read_claim(f"{claim_prefix}{rank}")
                if claim is None:
                    continue                   # still being written
                claims[rank] = claim
                if claim["size"] != p.size:
                    error = f"rank {rank} (on {claim['host']}) says -pn {claim['size']}, rank 0 says -pn {p.size}"
        if error is None and len(claims) < p.size - 1:
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, p.size)) - set(claims))
                error = (f"rank(s) {', '.join(map(str, missing))} never claimed a rank in {p.fs_path} within "
                         f"{p.timeout:g} s (job {p.job})")
            time.sleep(FS_POLL_SECONDS)
    if error is None:
        try:
            check_distinct_gpus([(0, p.host, p.local_rank)] + [(r, c["host"], c["local_rank"]) for r, c in claims.items()])
        except RendezvousError as e:
            error = str(e)
    if error is None and agreement is not None:
        error = disagreement({0: agreement, **{r: c.get("agreement") for r, c in claims.items()}})
    message = {"nonces": {str(r): c["nonce"] for r, c in claims.items()}}
    message.update({"error": error} if error else {"id": bytes(unique_id).hex()})
    tmp = f"{id_path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(message, f)
    os.replace(tmp, id_path)
    while any(os.path.exists(f"{claim_prefix}{r}") for r in claims) and time.monotonic() < deadline + p.timeout:
        time.sleep(FS_POLL_SECONDS)
    os.remove(id_path)
    if error:
        raise RendezvousError(error)


def read_claim(path):
    """A claim file's content (dict), or None while it is still empty or partly written."""
    try:
        with open(path) as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return None


def fs_receive_id(p, agreement=None):
    """Ranks 1..N-1: claim rank p.rank (create `<job>.rank<R>` exclusively, with a random nonce),
    wait for rank 0's id file to name our nonce, read it, remove the claim (telling rank 0 we have
    it). Returns the id bytes. Raises RendezvousError for a rank claimed twice (or a claim file of
    an earlier job), a refusal from rank 0, a stale id file, or no id within p.timeout. The claim is
    removed however it ends."""
    claim_prefix, id_path, _ = fs_names(p)
    claim_path, nonce = f"{claim_prefix}{p.rank}", secrets.token_hex(16)
    try:
        fd = os.open(claim_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        raise RendezvousError(f"rank {p.rank} is claimed twice: {claim_path} exists (another process with -pr {p.rank}, "
                              f"or a file left by an earlier job named {p.job}: remove it)") from None
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"size": p.size, "host": p.host, "local_rank": p.local_rank, "nonce": nonce,
                       "agreement": agreement}, f)
        deadline, stale = time.monotonic() + p.timeout, False
        while True:
            message = read_claim(id_path) if os.path.exists(id_path) else None
            if message is not None:
                if message.get("nonces", {}).get(str(p.rank)) == nonce:
                    break
                stale = True                   # written before our claim: an earlier job's
            if time.monotonic() > deadline:
                why = (f"{id_path} is stale (an earlier job named {p.job}: remove it)" if stale else
                       f"rank 0 did not write {id_path} within {p.timeout:g} s (a rank never arrived?)")
                raise RendezvousError(f"rank {p.rank}: {why}")
            time.sleep(FS_POLL_SECONDS)
    finally:
        if os.path.exists(claim_path):
            os.remove(claim_path)
    if "error" in message:
        raise RendezvousError(f"rank 0 refused the rendezvous: {message['error']}")
    unique_id = bytes.fromhex(message["id"])
    if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
        raise RendezvousError(f"rank {p.rank}: {id_path} holds {len(unique_id)} of the {NCCL_UNIQUE_ID_BYTES} bytes "
                              f"of the NCCL id")
    return unique_id


class FsStopLine:
    """-pm fs's stop line: stop(code) writes `<job>.abort` (rank and code); a watcher thread polls
    for it every STOP_POLL_SECONDS and calls on_stop(code, reason). The file stays, a record of who
    stopped the job, until the next run with this job name starts. A rank killed outright writes
    nothing: under srun, --kill-on-bad-exit=1 ends the others (scripts/multi_node/)."""

    def __init__(self, rank, path):
        self.rank, self.path, self.done = rank, path, False

    def stop(self, code):
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"rank": self.rank, "code": code}, f)
        os.replace(tmp, self.path)

    def goodbye(self):
        self.done = True

    def watch(self, on_stop):
        def run():
            while not self.done:
                message = read_claim(self.path) if os.path.exists(self.path) else None
                if message is not None and message["rank"] != self.rank and not self.done:
                    on_stop(message["code"], f"rank {message['rank']} failed (exit code {message['code']})")
                    return
                time.sleep(STOP_POLL_SECONDS)
        threading.Thread(target=run, name="llmc-stop-line", daemon=True).start()


def exchange_id(p, make_id, agreement=None):
    """The tcp or fs rendezvous of placement p: rank 0 calls make_id() for the id (bytes) and
    hands it out; every rank returns (id bytes, its stop line or None for one process). With an
    agreement (a JSON-able dict), rank 0 hands out the id only if every rank's equals its own."""
    if p.size == 1:
        return bytes(make_id()), None
    if p.method == "tcp":
        if p.rank == 0:
            unique_id = bytes(make_id())
            return unique_id, TcpStopLine(0, tcp_serve_id(unique_id, p, agreement))
        unique_id, sock = tcp_receive_id(p, agreement)
        return unique_id, TcpStopLine(p.rank, {0: sock})
    if p.rank == 0:
        unique_id = bytes(make_id())
        fs_serve_id(unique_id, p, agreement)
    else:
        unique_id = fs_receive_id(p, agreement)
    return unique_id, FsStopLine(p.rank, fs_names(p)[2])


# ----------------------------------------------------------------------------
# the process group the trainer uses: rank, size, host reductions, the NCCL communicator

def nccl_id_to_bytes(unique_id):
    """cupy.cuda.nccl.get_unique_id()'s id -> its 128 bytes: CuPy 14 gives bytes already, CuPy 13 a
    tuple of 128 C chars (signed)."""
    if isinstance(unique_id, bytes):
        return unique_id
    return bytes(b & 0xFF for b in unique_id)


def nccl_id_from_bytes(data):
    """128 bytes -> CuPy 13's form of the id: the tuple of signed chars its NcclCommunicator takes."""
    return tuple(b - 256 if b > 127 else b for b in data)


def nccl_communicator(nccl, size, unique_id, rank):
    """nccl.NcclCommunicator(size, id, rank) (library call: ncclCommInitRank) with the id (128 bytes)
    in the installed CuPy's form: bytes for CuPy 14 (`bytes commId`), and where CuPy refuses them
    with a TypeError (CuPy 13's `tuple commId`, checked before NCCL is called) the tuple of signed chars."""
    try:
        return nccl.NcclCommunicator(size, unique_id, rank)
    except TypeError:
        return nccl.NcclCommunicator(size, nccl_id_from_bytes(unique_id), rank)


class ProcessGroup:
    """What gpt2_cuda.py's training loop calls `comm`: rank, size, local_rank, and averages of
    host values across the processes (mean_, mean, sum, barrier: llmc.comm.Comm's calls). Under -pm
    mpi they are MPI's; under tcp / fs, an NCCL all-reduce of float64s through a device buffer,
    once connect() has made the communicator. connect() returns the llmc.comm.NcclComm for the
    gradients (None for one process)."""

    def __init__(self, placement, mpi=None, unique_id=None, stop_line=None):
        self.placement, self.mpi, self.unique_id, self.stop_line = placement, mpi, unique_id, stop_line
        self.method = placement.method
        self.rank, self.size, self.local_rank = placement.rank, placement.size, placement.local_rank
        self.comm = mpi.comm if mpi is not None else None      # llmc.comm.NcclComm's MPI broadcast
        self.nccl = None

    def connect(self):
        """After cuda.select_device: join the NCCL communicator (a collective: every rank calls
        it) and say on each rank which GPU it took. Returns the NcclComm or None for one process."""
        if self.size == 1:
            return None
        if self.mpi is not None:
            self.nccl = llmc_comm.NcclComm(self.mpi)
        else:
            self.nccl = NcclGroupComm(self.rank, self.size, self.unique_id)
        p = self.placement
        print(f"rank {self.rank}/{self.size} (-pm {self.method}): GPU {self.local_rank} of {p.host} "
              f"(local rank from {p.local_source})", flush=True)
        return self.nccl

    def stop_now(self, code, reason):
        """The stop line's watcher: another rank failed. Abort NCCL and exit with its code now."""
        print(f"error: rank {self.rank} stops: {reason}", file=sys.stderr, flush=True)
        abort = getattr(getattr(self.nccl, "communicator", None), "abort", None)
        if abort is not None:
            try:
                abort()
            except Exception:                  # the communicator may already be broken
                pass
        os._exit(code)

    def mean_(self, arr):
        """In place: arr (a NumPy array) = its mean over all processes."""
        if self.size == 1:
            return arr
        if self.mpi is not None:
            return self.mpi.mean_(arr)
        if self.nccl is None:
            raise RuntimeError("host reductions under -pm tcp/fs go through NCCL: call connect() first")
        arr[...] = self.nccl.host_sum(arr) / self.size
        return arr

    def mean(self, x):
        """Mean of a Python float over all processes."""
        return float(self.mean_(np.array([x], dtype=np.float64))[0])

    def sum(self, x):
        """Sum of a Python float over all processes."""
        return self.mean(x) * self.size

    def barrier(self):
        """Wait until every process gets here."""
        if self.mpi is not None:
            self.mpi.barrier()
        elif self.size > 1:
            self.mean(0.0)


class NcclGroupComm(llmc_comm.NcclComm):
    """llmc.comm.NcclComm joined with an id from the tcp / fs rendezvous instead of MPI's broadcast,
    plus host_sum: a sum of host float64s over the ranks through a device buffer (library call:
    ncclAllReduce)."""

    def __init__(self, rank, size, unique_id):
        self.nccl = cuda.library("nccl")
        self.communicator = nccl_communicator(self.nccl, size, unique_id, rank)
        self.rank, self.size = rank, size

    def host_sum(self, arr):
        """Sum over all ranks of a NumPy array (returned as float64; arr is not changed)."""
        cp = cuda.cupy()
        buf = cp.asarray(np.ascontiguousarray(arr, dtype=np.float64))
        self.communicator.allReduce(cuda.address(buf), cuda.address(buf), buf.size, self.nccl.NCCL_FLOAT64,
                                    self.nccl.NCCL_SUM, cp.cuda.get_current_stream().ptr)
        return cp.asnumpy(buf)                 # waits for the all-reduce


# ----------------------------------------------------------------------------
# set-up: the one call a trainer makes

def init_process_group(args, env=os.environ, agreement_of=None):
    """The ProcessGroup of this process from the flags (add_flags) and the environment. -pm mpi:
    llmc.comm.Comm (MPI under mpiexec, else one process); tcp / fs: the rendezvous, after which the
    stop line is wired into llmc.comm.abort_all_ranks, uncaught exceptions and a normal exit. With
    agreement_of (args -> a JSON-able dict: llmc.cli.agreement_config), the tcp / fs rendezvous also
    checks that every rank's is rank 0's (under mpi, llmc.cli.check_ranks_agree does, with MPI).
    Raises InputError (RendezvousError) with one line."""
    if args.init_method == "mpi":
        mpi = llmc_comm.Comm()
        launcher = launcher_environment(env)
        local = launcher[3] if launcher and launcher[3] is not None else mpi.rank % args.gpus_per_node
        p = Placement("mpi", mpi.rank, mpi.size, local, socket.gethostname(),
                      local_source=f"{launcher[0]}'s local rank" if launcher and launcher[3] is not None else "-pr % -pg")
        if mpi.comm is not None:
            check_distinct_gpus(mpi.comm.allgather((mpi.rank, p.host, p.local_rank)))
        return ProcessGroup(p, mpi=mpi)
    p = resolve_placement(args, env)

    def make_id():
        return nccl_id_to_bytes(cuda.library("nccl").get_unique_id())
    agreement = agreement_of(args) if agreement_of is not None and p.size > 1 else None
    unique_id, stop_line = exchange_id(p, make_id, agreement)
    group = ProcessGroup(p, unique_id=unique_id, stop_line=stop_line)
    if stop_line is not None:
        wire_stop_line(stop_line, group.stop_now)
    return group


def wire_stop_line(stop_line, on_stop):
    """From the rendezvous on (a rank may fail before NCCL is up, while the others wait in its
    initialization): watch for the other ranks' stop notices (on_stop(code, reason)), and make every
    way this process can end reach them: llmc.comm.abort_all_ranks (an error the command line
    caught) sends a stop notice and exits; an uncaught exception sends one before the traceback; a
    normal exit says goodbye."""
    stop_line.watch(on_stop)

    def stop_others(code):
        stop_line.stop(code)
        stop_line.goodbye()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    llmc_comm.ABORT_HOOKS.append(stop_others)
    previous_hook = sys.excepthook

    def excepthook(kind, value, traceback):
        stop_line.stop(1)
        stop_line.goodbye()
        previous_hook(kind, value, traceback)
    sys.excepthook = excepthook
    atexit.register(stop_line.goodbye)


# ----------------------------------------------------------------------------
# python -m llmc.multinode: check the rendezvous of a cluster (no GPU, no NCCL)

def main(argv=None):
    """Each process: the rendezvous with a random id from rank 0, then one line with the SHA-256
    of the id it holds. --fail-rank R checks the stop line: rank R fails after the rendezvous and
    the others, waiting, must stop at once. Returns the exit code (1 with one `error:` line)."""
    parser = ArgumentParser(prog="python -m llmc.multinode", description="check the tcp/fs rendezvous")
    add_flags(parser)
    parser.add_argument("--fail-rank", type=int, default=-1, help="this rank fails after the rendezvous (-1: none)")
    parser.add_argument("--hold", type=float, default=0.0, help="seconds to wait after the rendezvous before exiting")
    args = parser.parse_args(argv)
    try:
        if args.init_method == "mpi":
            raise InputError("-pm mpi: use mpiexec's own checks; this checks -pm tcp and fs")
        p = resolve_placement(args)
        unique_id, stop_line = exchange_id(p, lambda: os.urandom(NCCL_UNIQUE_ID_BYTES))
        if stop_line is not None:
            wire_stop_line(stop_line, ProcessGroup(p, stop_line=stop_line).stop_now)
        print(f"rank {p.rank}/{p.size} ({p.method}): id sha256 {hashlib.sha256(unique_id).hexdigest()}, "
              f"GPU {p.local_rank} of {p.host}", flush=True)
        if p.rank == args.fail_rank:
            raise InputError(f"rank {p.rank} fails on purpose (--fail-rank)")
        time.sleep(args.hold)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        llmc_comm.abort_all_ranks(1)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
