"""Every port a Ray node opens: pinned from a base port, or a block chosen free on this host."""

from __future__ import annotations

import random
import socket
from dataclasses import asdict, dataclass


def _port_free(port: int, host: str = "") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


@dataclass(frozen=True)
class RayPorts:
    """Every port a Ray node listens on. Head-only: ``gcs``, ``dashboard``."""

    gcs: int = 6379
    node_manager: int = 6380
    object_manager: int = 6381
    runtime_env_agent: int = 6382
    metrics_export: int = 6383
    dashboard_agent_listen: int = 6384
    dashboard_agent_grpc: int = 6385
    dashboard: int = 6386
    min_worker: int = 6479
    max_worker: int = 7478

    @classmethod
    def from_base(cls, base: int, n_worker_ports: int = 1000) -> RayPorts:
        """``base`` .. ``base+7`` for the services, ``base+100`` .. for worker processes."""
        if base < 1024 or base + 100 + n_worker_ports > 65535:
            raise ValueError(f"RayPorts.from_base: base {base} out of range")
        return cls(*range(base, base + 8), base + 100, base + 99 + n_worker_ports)

    @classmethod
    def find_free(cls, n_worker_ports: int = 64, *, low: int = 20000, high: int = 32000) -> RayPorts:
        """A ``from_base`` layout whose ports are all free on this host now (for tests and one-node runs).

        The default range stays below Linux's ephemeral ports (32768+) so that no outgoing connection takes
        one of them between this check and ``ray start``."""
        rng = random.Random()
        for _ in range(200):
            base = rng.randrange(low, high - 100 - n_worker_ports)
            ports = cls.from_base(base, n_worker_ports)
            if all(_port_free(p) for p in ports.all()):
                return ports
        raise RuntimeError(f"RayPorts.find_free: no free port block in {low}..{high}")

    def all(self) -> list[int]:
        return [*asdict(self).values()][:-2] + list(range(self.min_worker, self.max_worker + 1))

    def node_args(self) -> list[str]:
        return [
            f"--node-manager-port={self.node_manager}",
            f"--object-manager-port={self.object_manager}",
            f"--runtime-env-agent-port={self.runtime_env_agent}",
            f"--metrics-export-port={self.metrics_export}",
            f"--dashboard-agent-listen-port={self.dashboard_agent_listen}",
            f"--dashboard-agent-grpc-port={self.dashboard_agent_grpc}",
            f"--min-worker-port={self.min_worker}",
            f"--max-worker-port={self.max_worker}",
        ]

    def head_args(self) -> list[str]:
        return [f"--port={self.gcs}", f"--dashboard-port={self.dashboard}", *self.node_args()]
