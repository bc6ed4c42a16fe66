"""The tests' free ports: `proxy.ports` (below the kernel's ephemeral range)."""

from proxy.ports import free_port, free_port_range

__all__ = ["free_port", "free_port_range"]
