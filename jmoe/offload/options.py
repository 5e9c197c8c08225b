"""Offload options: everything `jmoe.load` and the command lines accept about where weights live and how
the expert cache behaves, checked once, in one place, before anything is read or allocated."""

from __future__ import annotations

import dataclasses
import re

from jmoe.arguments import positive_finite, whole_number
from jmoe.errors import InputError
from jmoe.offload.layer_groups import LayerGroups, layer_groups_from
from jmoe.offload.policies import CachePolicy, policy_factory

MISS_MODES = ("fetch", "host")


@dataclasses.dataclass(frozen=True)
class OffloadOptions:
    """See `jmoe.load` for the meaning of each field."""

    cache: int | None = None  # experts per MoE layer on the device; None = all
    policy: str | CachePolicy = "lfru"
    offload_params: tuple[str, ...] = ()
    device_budget_gb: float | None = None
    prefetch: int = 0
    miss_mode: str = "fetch"
    offload_group_size: int = 0
    offload_num_in_group: int = 1
    offload_prefetch_step: int = 1

    def __post_init__(self):
        if self.cache is not None:
            object.__setattr__(self, "cache", whole_number("cache", self.cache, 0,
                                                                        "experts kept on the device per MoE layer"))
        if self.device_budget_gb is not None:
            budget = positive_finite("device_budget_gb (GB)", self.device_budget_gb)
            object.__setattr__(self, "device_budget_gb", budget)
            if self.cache is not None:
                raise InputError(f"give either cache ({self.cache}) or device_budget_gb ({budget}), not both: "
                                 f"the budget chooses the cache")
        patterns = self.offload_params
        if isinstance(patterns, str):
            patterns = (patterns,)
        if patterns is None:
            patterns = ()
        if not all(isinstance(p, str) and p for p in patterns):
            raise InputError(f"offload_params must be a list of non-empty name patterns, found {patterns!r}")
        for pattern in patterns:
            if pattern.startswith("re:"):
                try:
                    re.compile(pattern[3:])
                except re.error as e:
                    raise InputError(f"offload_params pattern {pattern!r} is not a valid regular expression "
                                     f"({e}); fix it or use a plain dotted pattern such as 'w_down'") from None
        object.__setattr__(self, "offload_params", tuple(patterns))
        object.__setattr__(self, "prefetch", whole_number("prefetch", self.prefetch, 0,
                                                                     "experts per layer copied ahead, 0 = off"))
        if self.miss_mode not in MISS_MODES:
            raise InputError(f"miss_mode must be one of {', '.join(MISS_MODES)}, found {self.miss_mode!r}")
        if isinstance(self.policy, str):
            try:
                policy_factory(self.policy)
            except ValueError as e:
                raise InputError(str(e)) from None
        elif not isinstance(self.policy, CachePolicy):
            raise InputError(f"policy must be a policy name or a jmoe.offload.policies.CachePolicy, found "
                             f"{type(self.policy).__name__}")
        self.layer_groups  # checks the group settings

    @property
    def layer_groups(self) -> LayerGroups | None:
        return layer_groups_from(self.offload_group_size, self.offload_num_in_group, self.offload_prefetch_step)
