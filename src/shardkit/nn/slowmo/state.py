"""The SlowMo wrapper's state: public accessors to its components, and the hooks that save and load push-sum state.

:class:`SlowMoStateMixin` is a base class of :class:`~shardkit.nn.slowmo.api.SlowMoDistributedDataParallel`, kept
apart from the training-loop hooks: ``state_dict()`` adds the push-sum weight and form (``ps_weight``,
``is_sgp_ps_numerator``) where buffers of the wrapper would be, ``load_state_dict()`` takes them out again, drops
gossip in flight and re-anchors slow momentum at the loaded point.

Example::

    net = SlowMoDistributedDataParallel(model, nprocs_per_node=1, slowmo_base_algorithm=SlowMoBaseAlgorithm.SGP)
    state = net.state_dict()  # holds "ps_weight" and "is_sgp_ps_numerator"
    net.load_state_dict(state)
    weight = net.push_sum_state.weight
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from shardkit.nn.slowmo.flat import FlatParams
from shardkit.nn.slowmo.gossip import Gossiper
from shardkit.nn.slowmo.push_sum import ParamForm, PushSumState
from shardkit.nn.slowmo.slow_momentum import SlowMomentum


class SlowMoStateMixin(nn.Module):
    """Accessors and state-dict hooks over the components the SlowMo wrapper builds (see the module docstring).

    The wrapper sets the attributes declared here before it calls :meth:`_register_state_hooks`.

    Example::

        class Wrapper(SlowMoStateMixin): ...  # as SlowMoDistributedDataParallel does
    """

    _push_sum: Optional[PushSumState]
    _gossiper: Optional[Gossiper]
    _slow: Optional[SlowMomentum]
    _flat: FlatParams
    _working: FlatParams

    def _register_state_hooks(self) -> None:
        self._register_state_dict_hook(self._add_push_sum_state)
        self._register_load_state_dict_pre_hook(self._take_push_sum_state)
        self.register_load_state_dict_post_hook(self._after_load)

    @property
    def gossiper(self) -> Optional[Gossiper]:
        """The gossip component (SGP on a node master), else None; checkpoints read its round and rounds in flight."""
        return self._gossiper

    @property
    def slow_momentum(self) -> Optional[SlowMomentum]:
        """The slow-momentum component (its ``anchor`` and ``momentum`` buffers), None when slow momentum is off."""
        return self._slow

    @property
    def push_sum_state(self) -> Optional[PushSumState]:
        """The push-sum weight and parameter form (SGP), else None."""
        return self._push_sum

    def restart_from_parameters(self) -> None:
        """Take the current parameters as a point every rank shares (e.g. just loaded from a checkpoint average):
        gossip in flight is dropped, the push-sum weight becomes 1 and the slow-momentum anchor is reset here."""
        if self._gossiper is not None:
            self._gossiper.close()
        if self._push_sum is not None:
            self._push_sum.load(1.0, True)
        self._after_load(self, None)

    def _add_push_sum_state(
        self, _module: nn.Module, destination: dict[str, Any], prefix: str, local_metadata: Any
    ) -> None:
        """State-dict hook: the push-sum weight and form, placed where buffers of this module would be.

        The hook runs after the children have saved, so the wrapped module's entries are moved behind the new
        ones: ``state_dict()`` keeps the order it would have if the two were buffers of the wrapper.
        """
        if self._push_sum is None:
            return
        children = [k for k in destination if k.startswith(prefix) and "." in k[len(prefix) :]]
        for key, value in self._push_sum.state().items():
            destination[prefix + key] = value
        for key in children:
            destination[key] = destination.pop(key)

    def _take_push_sum_state(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """Load-state-dict pre hook: take the push-sum entries out before the parameters load."""
        weight = state_dict.pop(prefix + "ps_weight", None)
        is_numerator = state_dict.pop(prefix + "is_sgp_ps_numerator", True)
        if self._push_sum is not None:
            if self._gossiper is not None:
                self._gossiper.close()  # rounds in flight belong to the parameters being replaced
            self._push_sum.load(1.0 if weight is None else weight, is_numerator)

    def _after_load(self, _module: nn.Module, _incompatible_keys: Any) -> None:
        # The slow-momentum anchor x0 must be the loaded point, not the one the wrapper was built with.
        if self._push_sum is not None:
            self._push_sum.to(ParamForm.NUMERATOR)
        if self._slow is not None:
            self._slow.reset_anchor(self._flat)
        self._working = self._flat
