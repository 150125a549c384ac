"""An emulated multi-host cluster on one machine: one network namespace per Horovod rank.

Each rank runs in its own namespace ``hvdsN`` with one interface ``eth0`` (a veth whose
peer is attached to the bridge ``hvdsbr0`` in the root namespace). Both ends of every link
are shaped with ``tc tbf`` (rate) and, optionally, ``tc netem`` (added delay; needs the
sch_netem module), so each rank has its own NIC of the chosen speed in each direction.
Addresses come from the benchmarking range 198.18.0.0/15 only:
the bridge is 198.18.0.1/24 and rank i is 198.18.0.(10 + i)/24.

Ranks start through Horovod's Gloo launch contract, without ssh: a Horovod
``RendezvousServer`` in the root namespace (listening on the bridge address) plus the
per-rank environment that ``horovodrun --gloo`` would set.

Horovod's process-set Gloo contexts must honour ``HOROVOD_GLOO_IFACE`` for this to work
across namespaces; ``ci/bootstrap`` fix (d) makes them do so.

Needs root (``ip netns``, ``tc``); :func:`require_root` explains and exits otherwise.
Everything created is removed on exit, on failure and on Ctrl-C.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

__all__ = ["PRESETS", "Cluster", "LinkSpec", "require_root"]

BRIDGE = "hvdsbr0"
BRIDGE_ADDRESS = "198.18.0.1"
SUBNET_BITS = 24


@dataclass(frozen=True)
class LinkSpec:
    """Per-rank NIC: ``rate`` in tc syntax (``1gbit``), one-way ``delay_ms``."""

    rate: str
    delay_ms: float = 0.0

    @property
    def label(self) -> str:
        return f"{self.rate}" + (f"+{self.delay_ms:g}ms" if self.delay_ms else "")


PRESETS = {"1g": LinkSpec("1gbit"), "10g": LinkSpec("10gbit"), "25g": LinkSpec("25gbit")}


def require_root() -> None:
    """Exit with a clear message (status 0: a skip, not a failure) when not root."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if os.geteuid() != 0 or missing:
        why = "needs root" if os.geteuid() != 0 else f"needs {', '.join(missing)} (iproute2)"
        print(
            f"SKIPPED: the emulated cluster {why}: it creates network namespaces, veth "
            "links and tc qdiscs. Run as root, e.g. sudo -E make cluster-bench."
        )
        sys.exit(0)


def _sh(*args: str, netns: str | None = None, check: bool = True) -> None:
    """Run a command (``ip ...`` or ``tc ...``), inside ``netns`` if given."""
    cmd = (["ip", "netns", "exec", netns] if netns else []) + list(args)
    subprocess.run(cmd, check=check, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _ip(*args: str, netns: str | None = None, check: bool = True) -> None:
    _sh("ip", *args, netns=netns, check=check)


def _rate_bits(rate: str) -> int:
    """``1gbit`` -> 1e9 (tc's decimal units)."""
    units = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "bit": 1}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return int(float(rate[: -len(unit)]) * scale)
    raise ValueError(f"rate must end in one of {list(units)}, got {rate!r}")


@dataclass
class Cluster:
    """Context manager owning the namespaces, links and the rendezvous server.

    Example:
        >>> with Cluster(4, PRESETS["1g"]) as cluster:
        ...     cluster.run([sys.executable, "train.py"], timeout=600)
    """

    size: int
    link: LinkSpec
    prefix: str = "hvds"
    _created: list[str] = field(default_factory=list)

    def namespace(self, rank: int) -> str:
        return f"{self.prefix}{rank}"

    def address(self, rank: int) -> str:
        return f"198.18.0.{10 + rank}"

    # ---------------------------------------------------------------- setup / teardown
    def __enter__(self) -> Cluster:
        if not 1 <= self.size <= 200:
            raise ValueError(f"cluster size must be in [1, 200], got {self.size}")
        atexit.register(self.close)
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._on_signal)
        self.close()  # leftovers of an interrupted earlier run
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _on_signal(self, signum: int, frame: object) -> None:
        self.close()
        raise KeyboardInterrupt(f"signal {signum}")

    def _shape(self, device: str, netns: str | None) -> None:
        """Rate with ``tbf`` (always available); added delay with ``netem`` under it."""
        bits = _rate_bits(self.link.rate)
        burst = max(64 * 1024, bits // 8 // 250)  # >= one timer tick of data at HZ=250
        tbf = [
            "tc",
            "qdisc",
            "replace",
            "dev",
            device,
            "root",
            "handle",
            "1:",
            "tbf",
            "rate",
            self.link.rate,
            "burst",
            str(burst),
            "latency",
            "50ms",
        ]
        _sh(*tbf, netns=netns)
        if self.link.delay_ms:
            netem = [
                "tc",
                "qdisc",
                "add",
                "dev",
                device,
                "parent",
                "1:1",
                "handle",
                "10:",
                "netem",
                "delay",
                f"{self.link.delay_ms}ms",
            ]
            try:
                _sh(*netem, netns=netns)
            except subprocess.CalledProcessError as error:
                raise RuntimeError(
                    "added latency needs the sch_netem qdisc, which this kernel does not "
                    "provide; run without --delay-ms"
                ) from error

    def _build(self) -> None:
        _ip("link", "add", BRIDGE, "type", "bridge")
        self._created.append(f"link:{BRIDGE}")
        _ip("addr", "add", f"{BRIDGE_ADDRESS}/{SUBNET_BITS}", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")
        for rank in range(self.size):
            ns, host_end = self.namespace(rank), f"{self.prefix}{rank}h"
            _ip("netns", "add", ns)
            self._created.append(f"netns:{ns}")
            _ip("link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._created.append(f"link:{host_end}")
            _ip("link", "set", host_end, "master", BRIDGE)
            _ip("link", "set", host_end, "up")
            _ip("addr", "add", f"{self.address(rank)}/{SUBNET_BITS}", "dev", "eth0", netns=ns)
            _ip("link", "set", "eth0", "up", netns=ns)
            _ip("link", "set", "lo", "up", netns=ns)
            self._shape("eth0", ns)  # rank -> bridge
            self._shape(host_end, None)  # bridge -> rank

    def close(self) -> None:
        """Remove everything this cluster (or an earlier interrupted one) created."""
        for rank in range(self.size):
            _ip("link", "del", f"{self.prefix}{rank}h", check=False)
            _ip("netns", "del", self.namespace(rank), check=False)
        _ip("link", "del", BRIDGE, check=False)
        self._created.clear()

    # ---------------------------------------------------------------- launch
    def run_distributed(
        self, command: list[str], timeout: float, env: dict[str, str] | None = None
    ) -> int:
        """Run ``command`` as one ``torch.distributed`` rank per namespace (the variables
        torchrun sets; rank 0's address is the store); returns the worst exit code."""
        base = dict(os.environ, **(env or {}))
        base.update(
            MASTER_ADDR=self.address(0),
            MASTER_PORT="29512",
            WORLD_SIZE=str(self.size),
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            GLOO_SOCKET_IFNAME="eth0",
        )
        environments = [dict(base, RANK=str(rank)) for rank in range(self.size)]
        return self._launch(command, environments, timeout)

    def _launch(
        self, command: list[str], environments: list[dict[str, str]], timeout: float
    ) -> int:
        """One process per namespace, rank r with ``environments[r]``; the worst exit code.

        Raises:
            TimeoutError: the ranks did not finish within ``timeout`` seconds (all killed).
        """
        procs = []
        try:
            for rank, environment in enumerate(environments):
                procs.append(
                    subprocess.Popen(
                        ["ip", "netns", "exec", self.namespace(rank), *command],
                        env=environment,
                        start_new_session=True,
                    )
                )
            deadline = time.monotonic() + timeout
            codes = []
            for proc in procs:
                codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
            return max(codes)
        except subprocess.TimeoutExpired as error:
            raise TimeoutError(f"cluster run exceeded {timeout:.0f}s") from error
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()

    def run(self, command: list[str], timeout: float, env: dict[str, str] | None = None) -> int:
        """Run ``command`` as one Horovod rank per namespace; returns the worst exit code.

        Raises:
            TimeoutError: the ranks did not finish within ``timeout`` seconds (all killed).
        """
        from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
        from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars
        from horovod.runner.http.http_server import RendezvousServer

        hosts = ",".join(f"{self.namespace(r)}:1" for r in range(self.size))
        plan = get_host_assignments(parse_hosts(hosts), self.size)
        server = RendezvousServer(verbose=0)
        port = server.start()
        server.init(plan)
        base = dict(os.environ, **(env or {}))
        base.update(
            {k: str(v) for k, v in create_run_env_vars(BRIDGE_ADDRESS, ["eth0"], port).items()}
        )
        try:
            slots = sorted(plan, key=lambda slot: slot.rank)  # namespace r runs rank r
            environments = [dict(base, **create_slot_env_vars(slot)) for slot in slots]
            return self._launch(command, environments, timeout)
        finally:
            server.stop()
