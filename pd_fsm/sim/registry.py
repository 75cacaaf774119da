"""The simulated bootstrap server (``pd_fsm.sim``): the core's ``BootstrapRegistry`` on the
registry host's clock. P registers and beats; D resolves P's bootstrap address; a crash takes it
down for a while, and it comes back empty (the workers register again on their next beat)."""

from __future__ import annotations

from pd_fsm.core import events as ev
from pd_fsm.core.config import RegistryConfig
from pd_fsm.core.registry import BootstrapRegistry, RegistrationRequired
from pd_fsm.sim.config import LAYOUT, REGISTRY_TTL
from pd_fsm.sim.workers import Clock, DecodeWorker, Node, PrefillWorker


class Registry:
    def __init__(self, world: Clock) -> None:
        self.world = world
        self.core: BootstrapRegistry[tuple[str, str]] = BootstrapRegistry(
            RegistryConfig(ttl=REGISTRY_TTL))
        self.up = True

    def _now(self) -> float:
        return self.world.now + self.world.skew["registry"]

    def crash(self, down: float) -> None:
        self.up = False

        def restart() -> None:  # an empty registry: workers register again on their next beat
            self.core = BootstrapRegistry(RegistryConfig(ttl=REGISTRY_TTL))
            self.up = True

        self.world.at(down, "registry restarts", restart)

    def register(self, p: PrefillWorker) -> None:
        if self.up:
            self.core.handle(ev.InstanceRegistered(_key(p), (p.side, p.transfer), p.advertised,
                                                   REGISTRY_TTL), self._now())

    def heartbeat(self, p: PrefillWorker) -> None:
        if not self.up:
            return
        out = self.core.handle(ev.InstanceHeartbeat(_key(p)), self._now())
        if any(isinstance(e, RegistrationRequired) for e in out):
            self.register(p)

    def deregister(self, node: Node) -> None:
        if node.role == "prefill" and self.up:
            self.core.handle(ev.InstanceDeregistered(_key(node)), self._now())

    def resolve(self, d: DecodeWorker, bootstrap_addr: str) -> None:
        """D looks up P's bootstrap address; the answer reaches D a little later."""
        answer: ev.PeerResolved | ev.PeerResolutionFailed
        if not self.up:
            answer = ev.PeerResolutionFailed(bootstrap_addr, "bootstrap server unreachable")
        else:
            self.core.handle(ev.TimeAdvanced(), self._now())
            found = self.core.resolve(bootstrap_addr)
            if found:
                side, transfer = found[0][1]
                answer = ev.PeerResolved(bootstrap_addr, side, transfer, LAYOUT)
            else:
                answer = ev.PeerResolutionFailed(bootstrap_addr, "not registered")
        self.world.at(0.002, f"{d.name} lookup of {bootstrap_addr}", d.resolved, d.gen, answer)


def _key(p: Node) -> tuple[str, str, int, int, int, int]:
    return ("prefill", p.name, 0, 0, 0, 0)
