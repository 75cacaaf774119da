"""`pd-fsm sim`: the whole cluster's core, deterministic.

The real ``PrefillEndpoint`` / ``DecodeEndpoint`` of every worker, the proxy's ``RoomRouter`` and
the ``BootstrapRegistry`` run single-threaded on a virtual clock, over an in-memory network that
carries the real codec's signed frames. What the schedulers, the transfer engine and HTTP do is
modelled by ``workers.py`` (pages from a pool, registrations in a dict, pulls that take time);
faults are drawn from the seed. A seed replays bit for bit.
"""

from pd_fsm.sim.config import PLANTS, SimConfig, SimResult
from pd_fsm.sim.world import World, run_seed

__all__ = ["PLANTS", "SimConfig", "SimResult", "World", "run_seed"]
