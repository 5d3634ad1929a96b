"""Which communication each call of ``perform_slowmo`` does: a pure function of the settings and the step.

Keeping the schedule apart from the code that communicates makes the rules testable without processes and keeps
every rank's sequence of collectives identical by construction (every rank derives it from the same inputs).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardkit.nn.slowmo.config import SlowMoBaseAlgorithm, SlowMoConfig


@dataclass(frozen=True)
class StepPlan:
    """What one ``perform_slowmo`` call does, in this order.

    ``drain_gossip``: wait for every gossip round in flight and add what it received (overlap only).
    ``exact_average``: replace every node's parameters by their exact average (LocalSGD, or SGP's periodic average).
    ``slow_momentum``: run the slow-momentum step (it computes the exact average itself unless ``exact_average``
    already did this step, or it runs sharded, where the sharded exchange doubles as the average).
    ``gossip``: one gossip round (with overlap: start it; it completes at a later step).
    """

    step: int
    drain_gossip: bool = False
    exact_average: bool = False
    slow_momentum: bool = False
    gossip: bool = False

    def describe(self) -> str:
        """A short line for logs, e.g. ``step 11: exact_average slow_momentum``."""
        parts = [name for name in ("drain_gossip", "exact_average", "slow_momentum", "gossip") if getattr(self, name)]
        return f"step {self.step}: " + (" ".join(parts) if parts else "local step only")


def plan_step(config: SlowMoConfig, step: int, num_nodes: int, gossip_enabled: bool = True) -> StepPlan:
    """The plan for the ``perform_slowmo`` call after optimizer step number ``step`` (0-based).

    With one node there is nothing to average between nodes (gradients are already averaged inside the node), so
    only the slow-momentum step remains. ``gossip_enabled`` is False in eval mode: no new gossip round starts.
    """
    count = step + 1
    slow = config.slow_momentum
    outer = count % slow.frequency == 0
    slow_now = slow.enabled and outer
    multi_node = num_nodes > 1
    if config.wrapper.base_algorithm is SlowMoBaseAlgorithm.LOCALSGD:
        # The memory-efficient outer step averages as a side effect, so the LocalSGD average is skipped then.
        averaging_due = multi_node and count % config.local_sgd.frequency == 0
        exact = averaging_due and not (slow_now and slow.memory_efficient)
        return StepPlan(step, exact_average=exact, slow_momentum=slow_now)
    gossip_cfg = config.gossip
    # A slow-momentum step uses the exact average, which a gossip round in the same step cannot change (gossip
    # conserves the sum of the push-sum numerators): the round is replaced, not run before it.
    periodic_average = outer and not slow.enabled and gossip_cfg.average_params_on_slowmo
    synchronising = slow_now or periodic_average
    drain = multi_node and gossip_cfg.overlap and (synchronising or count % gossip_cfg.sync_every == 0)
    return StepPlan(
        step,
        drain_gossip=drain,
        exact_average=multi_node and periodic_average,
        slow_momentum=slow_now,
        gossip=multi_node and gossip_enabled and not synchronising,
    )
