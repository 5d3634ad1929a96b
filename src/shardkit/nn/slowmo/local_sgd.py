"""Exact parameter averaging across nodes: LocalSGD's periodic step, and SGP's optional periodic average.

LocalSGD (Lin et al., 2018) lets every node take ``localsgd_frequency`` optimizer steps on its own, then replaces
every node's parameters by their exact average. Here that is one flat all-reduce among node masters followed by a
broadcast inside each node.
"""

from __future__ import annotations

from typing import Optional

import torch

from shardkit.nn.slowmo.collectives import average_over_nodes
from shardkit.nn.slowmo.flat import FlatParams
from shardkit.nn.slowmo.layout import ProcessLayout, SlowMoGroups
from shardkit.nn.slowmo.push_sum import PushSumState


class ExactAverager:
    """Replaces the parameters on every rank by their average over nodes.

    With push-sum, the average of the numerators is the network's consensus value (gossip conserves their sum),
    so after averaging every node holds it with weight 1.
    """

    def __init__(self, layout: ProcessLayout, groups: SlowMoGroups, comm_device: torch.device) -> None:
        self.layout = layout
        self.groups = groups
        self.comm_device = comm_device

    def average(self, flat: FlatParams, push_sum: Optional[PushSumState] = None) -> None:
        """Average ``flat`` in place over nodes (and reset the push-sum weight to 1)."""
        buffer = flat.copy_to(flat.new_buffer(flat.tensors[0].dtype, self.comm_device))
        average_over_nodes(buffer, self.groups, self.layout)
        flat.copy_from(buffer)
        if push_sum is not None:
            push_sum.set_weight(1.0)
