"""The simulated cluster's windows, its configuration, and what a run returns (``pd_fsm.sim``)."""

from __future__ import annotations

import attrs

from pd_fsm.core.config import DecodeConfig, LeaseConfig
from pd_fsm.core.routing import RoutingConfig

LAYOUT = "sim-layout"
SECRET = b"pd_fsm sim cluster secret"
PAGE_TOKENS = 16
VOCAB = 50257
RECOMPUTABLE = frozenset({500, 502, 504})
TOLERANCE = 1.0  # seconds past a deadline before a live room is a violation (skew is per host)

# Windows of the simulated cluster: production's, scaled so that a seed's life is short.
LEASE = LeaseConfig(initial=10.0, extension=6.0)
DECODE = DecodeConfig(heartbeat_interval=1.0, peer_timeout=3.0, resolve_timeout=3.0,
                      queue_timeout=15.0, ready_timeout=20.0, transfer_timeout=12.0)
PULL_DEADLINE = 8.0  # the pull executor's: inside DECODE.transfer_timeout
ROOM_TIMEOUT = 40.0
REGISTRY_TTL = 6.0
REGISTRY_HEARTBEAT = 2.0
DRAIN = 90.0  # virtual seconds after the last arrival for everything to settle
# A role switch: its drain deadline (`pd-fsm serve --drain-timeout`) is drawn in
# this range, short enough that some switches fail what is left and long enough that most drain.
SWITCH_DRAIN = (0.3, 12.0)
SHORT_DRAIN = (0.02, 0.5)  # shorter than most rooms: most switches fail what is left
SWITCH_BUILD = (0.1, 1.5)  # seconds to build a role's backend from the loaded weights and warm it
SWITCH_START_FAILS = 0.08  # the chance that building a role raises (RoleStartFailed)
# Live KV hand-off: a draining D's offers are leased until this long before its drain
# deadline (`HANDOFF_LEASE_MARGIN_S`, scaled as the drains are); with less than the minimum lease
# left its streams finish in place. With faults, a seeded share of hand-off pulls is slow (past
# most leases) or fails, as PD pulls are, and a drain that hands streams off may crash during
# their pulls, or be cut from another D for a while, by these chances.
HANDOFF_MARGIN = 0.2
HANDOFF_MIN_LEASE = 0.1
HANDOFF_PULL_SLOW = 0.04
HANDOFF_PULL_FAILS = 0.05
HANDOFF_CRASH = 0.2
HANDOFF_PARTITION = 0.2
DISCOVERY = 1.0  # the proxy sees a worker leave or join its role's list within this many seconds


def bootstrap_addr(name: str) -> str:
    """The address a P advertises (its bootstrap host:port): routers and D know it by this."""
    return f"{name}:8998"

PLANTS = {
    "missing-release-on-done": "P keeps a room's pages when D's DONE releases it",
    "lease-shortens": "a heartbeat sets P's lease to now + half the extension",
    "no-ready-timeout": "D waits for READY forever (its WAITING_FOR_READY timeout removed)",
    "double-free": "D frees the pages of a room whose pull failed twice",
    "kv-pages-reversed": "D scatters a pulled room's pages in reverse order (real schedulers)",
    "unverified-kv": "D decodes from a pull whose KV arrived corrupted (its checksum check "
                     "skipped)",
    "switch-leaks": "a role switch past its drain deadline answers what is left with its error "
                    "but stops the old role without releasing those rooms' pages and "
                    "registrations",
    "switch-skips-drain": "a role switch's drain waits only for the core's rooms, not for the "
                          "scheduler's own (D's decoding rooms, its queue, its pages)",
    "part-leak": "P streams the KV in parts but releases only READY's registration when the "
                 "room ends, not the parts'",
    "release-without-cancel": "D frees the pages of a room that failed mid-pull without "
                              "cancelling its pull, whose KV may then land in them",
    "held-until-pull-reports": "D as it was: a room that failed mid-pull keeps its pages until "
                               "the pull reports, and a lost P's transfer connections are not "
                               "dropped, so P's death holds them until the pulls' deadline",
}
STREAM_PLANTS = frozenset({"part-leak"})
REAL_ONLY_PLANTS = frozenset({"kv-pages-reversed"})
# Planted bugs only a named scenario (scenarios.py) stages the fault for: plant -> scenario.
SCENARIO_PLANTS = {"held-until-pull-reports": "p-dies-mid-pull"}
SWITCH_PLANTS = frozenset({"switch-leaks", "switch-skips-drain"})


class Violation(Exception):
    """An invariant broke: the message says which, where and when."""


@attrs.frozen
class CostModel:
    """What work costs in virtual time. Defaults: SmolLM2-135M F32, one role per CPU core of
    this project's machine (bench/RESULTS_*.md: prefill ~400 tokens/s, decode ~50 ms/token at
    batch 1 and ~25 ms at batch 8), a KV pull at ~1 GB/s of 46 KB a token."""

    prefill_fixed: float = 0.02  # seconds a prefill costs whatever its length
    prefill_per_token: float = 0.0025
    decode_step: float = 0.05  # one token at batch 1 ...
    decode_step_per_row: float = 0.022  # ... plus this per other row in the batch
    kv_bytes_per_token: int = 46_080
    pull_bytes_per_second: float = 1e9

    def prefill(self, tokens: int) -> float:
        return self.prefill_fixed + self.prefill_per_token * tokens

    def step(self, rows: int) -> float:
        return self.decode_step + self.decode_step_per_row * max(rows - 1, 0)

    def pull(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token / self.pull_bytes_per_second


@attrs.frozen
class Workload:
    """Poisson arrivals at ``rate`` per second for ``duration`` seconds; each prompt is one of
    ``groups`` shared prefixes of ``prefix_tokens`` (0 groups: none) and a question of 8-64
    tokens; 1-``max_output`` tokens out."""

    rate: float = 2.0
    duration: float = 60.0
    groups: int = 8
    prefix_tokens: int = 200
    max_output: int = 32


@attrs.frozen
class SimConfig:
    prefill: int = 2
    decode: int = 2
    requests: int = 10
    arrival_window: float = 15.0  # arrivals spread uniformly over this many seconds
    faults: bool = True
    recompute: bool = False  # D prefills a room itself when P or the transfer fails it
    # KV checksums on every P and D (--disaggregation-kv-checksum), and among the faults some
    # pulls whose bytes arrive corrupted (which only the checksums can see).
    kv_checksum: bool = False
    # P streams a room's KV in parts of this many prompt tokens while it prefills
    # (--disaggregation-stream-tokens; 0: the whole KV after the prefill).
    stream_tokens: int = 0
    plant: str | None = None
    routing: RoutingConfig = attrs.field(factory=RoutingConfig)
    pages: int = 48  # per worker
    skew: float = 2.0  # each host's clock is off by up to this many seconds
    cost: CostModel = attrs.field(factory=CostModel)
    workload: Workload | None = None  # Poisson arrivals instead of ``requests`` spread uniformly
    # A pull from a P that died hangs until its deadline, as from a dead host (no reset ends
    # the connection), unless D drops the connection first (the core's ForgetTransfer, on P's
    # loss). Off: it fails when it would have arrived, as on a live host (the port refused).
    hung_pulls: bool = True
    # A named scenario (scenarios.py): a fault staged on purpose, checked on top of the rest.
    scenario: str | None = None
    # The first this many pulls each D starts never report, not even at their own deadline (a
    # pull executor stuck mid-transfer: sglang #31800's receiver left in Transferring).
    stuck_pulls: int = 0
    # The first this many pulls each D starts fail at once (a transfer error from a live P).
    failed_pulls: int = 0
    # "modelled": schedulers, pools and the transfer server are modelled (fast: thousands of
    # seeds); "real": the real PD schedulers on the tiny model run every step (sim/real.py).
    schedulers: str = attrs.field(default="modelled")
    # With faults: the chance that a seed asks a worker to switch its role (P to D or D to P;
    # drawn twice, so some seeds switch two), from a random stream of its own (``World``).
    role_switches: float = 0.25
    switch_drain: tuple[float, float] = SWITCH_DRAIN  # each switch's drain deadline, drawn in
    # With faults: the chance that a seed sends a worker SIGTERM (drained, then it exits and
    # restarts; drawn twice, so some seeds send two), from a random stream of its own
    # (``sigterm.py``), each with a drain deadline (``--drain-timeout``) drawn in ``sigterm_drain``.
    sigterms: float = 0.25
    sigterm_drain: tuple[float, float] = SWITCH_DRAIN

    @property
    def checksums(self) -> bool:
        """Whether the cluster runs KV checksums: the flag, or the planted bug of that path."""
        return self.kv_checksum or self.plant == "unverified-kv"

    @property
    def stream(self) -> int:
        """P's part size in tokens: ``stream_tokens``, or a small one with a planted bug of
        streaming's own (it shows only where parts are sent)."""
        return self.stream_tokens or (16 if self.plant in STREAM_PLANTS else 0)

    @property
    def switch_chance(self) -> float:
        """The chance of each switch draw: ``role_switches``, or every draw with a planted bug
        of the switch's own (it shows only where a switch happens)."""
        return 1.0 if self.plant in SWITCH_PLANTS else self.role_switches

    @property
    def drain_range(self) -> tuple[float, float]:
        """Where each switch's drain deadline is drawn: ``switch_drain``, or shorter than most
        rooms with the planted leak past the deadline (it shows only when one passes)."""
        return SHORT_DRAIN if self.plant == "switch-leaks" else self.switch_drain

    @schedulers.validator
    def _known(self, _: object, value: str) -> None:
        if value not in ("modelled", "real"):
            raise ValueError(f"schedulers must be 'modelled' or 'real', got {value!r}")


@attrs.define
class SimResult:
    seed: int
    violation: str | None
    answered: dict[str, int]  # status -> clients
    steps: int
    trace: list[str]
    # Role switches by outcome (RoleSwitch.OUTCOMES, and the world's own: "unreachable",
    # "declined", "crashed"), and by what each switch raced (``switch.RACES``) -> switches.
    switches: dict[str, int] = attrs.field(factory=dict)
    races: dict[str, int] = attrs.field(factory=dict)
    # Live KV hand-offs (handoff.py) by outcome: streams handed off; their hand-off rooms taken
    # (the KV pulled, the stream went on), fallen back to a migration, or failed; the draining
    # D's registrations released (by the proxy's word), expired (their lease), or closed with a
    # role stopped past its drain deadline; hand-off pulls failed, by cause ("pull ..."); the
    # clients handed off by final status ("client ...") and, other than 200, why ("lost ...").
    handoffs: dict[str, int] = attrs.field(factory=dict)
    # SIGTERMs by outcome (``sigterm.Stops``).
    sigterms: dict[str, int] = attrs.field(factory=dict)
    # A named scenario's outcomes (``scenarios.py``): staged, and its check passed.
    scenario: dict[str, int] = attrs.field(factory=dict)
