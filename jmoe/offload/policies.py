"""Expert-cache policies: which experts are worth keeping in each MoE layer's device slots.

A policy sees, after every step (a decode step, or a prefill chunk), how many tokens each expert
of each layer served, and ranks the experts by a priority. It never moves anything itself: the
offload manager (and the trace replay, ``jmoe.traces``) turn priorities into evictions with the one
shared rule, :func:`eviction_ranking` (and :func:`choose_victims`, built on it):

    on a miss, evict the resident expert with the LOWEST priority among those the current step
    does not need; ties are broken by evicting the LOWER expert id.

Everything is vectorised over ``[num_layers, num_experts]`` because the manager runs between
decode steps in Python and has a budget of ~200 us per step for 24 layers x 32 experts: no
Python loop over layers here.

What "counts" means to each policy (``counts[l, e]`` = tokens routed to expert ``e`` of layer
``l`` in the step just finished; at batch-1 decode it is 0 or 1):

- ``lru``: only whether an expert was used (``counts > 0``); priority = last step used.
- ``lfu``: the counts themselves, summed over all steps; a prefill chunk that sends 300 tokens
  to an expert counts 300, because that is how many token-computations would have missed.
- ``lfru``: counts, exponentially decayed per step, divided by ``1 + recency_weight * recency``.
- ``static``: ignores what it observes; ranks by a frequency table given up front and never
  admits a missed expert (``admits_misses = False``).

Subclassing: override :meth:`CachePolicy.update` (called by :meth:`CachePolicy.observe` with
validated counts, before the clock advances) and :meth:`CachePolicy.priority`; optionally
register the class with :func:`register_policy` so ``make_policy`` finds it by name.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

__all__ = [
    "CachePolicy",
    "LRUPolicy",
    "LFUPolicy",
    "LFRUPolicy",
    "StaticPolicy",
    "choose_victims",
    "eviction_ranking",
    "expert_counts",
    "initial_residents",
    "make_policy",
    "register_policy",
    "policy_names",
]


class CachePolicy:
    """Decides which experts are worth keeping in each MoE layer's device slots.

    Contract:
      * ``observe(counts)``: ``counts`` is an integer array ``[num_layers, num_experts]`` of
        accesses per expert in the step just finished (0 = unused). Advances ``self.step``.
      * ``priority()``: float array ``[num_layers, num_experts]``, higher = more worth keeping.
        It must be finite or +/-inf (no NaN). The caller may keep a reference only until the
        next ``observe``.
      * ``admits_misses``: if False, a missed expert is served from scratch and never enters
        the cache; the cache then holds :func:`initial_residents` of the first priority.
    """

    name: str = "base"
    admits_misses: bool = True

    def __init__(self, num_layers: int, num_experts: int):
        if int(num_layers) <= 0 or int(num_experts) <= 0:
            raise ValueError(
                f"{type(self).__name__}: expected num_layers > 0 and num_experts > 0, "
                f"found num_layers={num_layers}, num_experts={num_experts}"
            )
        self.num_layers = int(num_layers)
        self.num_experts = int(num_experts)
        self.step = 0  # number of observed steps; the step just observed has index step - 1

    @property
    def shape(self) -> tuple[int, int]:
        return (self.num_layers, self.num_experts)

    def observe(self, counts: np.ndarray) -> None:
        """Record the step just finished and advance the clock by one step."""
        counts = np.asarray(counts)
        if counts.shape != self.shape:
            raise ValueError(
                f"{self.name} policy: expected counts of shape [num_layers, num_experts] = "
                f"{list(self.shape)}, found {list(counts.shape)}"
            )
        self.update(counts)
        self.step += 1

    def update(self, counts: np.ndarray) -> None:
        """Subclass hook: fold one step's counts into the policy state (``self.step`` is the
        index of that step)."""
        raise NotImplementedError(f"{type(self).__name__} must implement update(counts)")

    def priority(self) -> np.ndarray:
        """Float ``[num_layers, num_experts]``: higher = more worth keeping."""
        raise NotImplementedError(f"{type(self).__name__} must implement priority()")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_layers={self.num_layers}, num_experts={self.num_experts})"


class LRUPolicy(CachePolicy):
    """Least recently used: priority = index of the last step that used the expert (-1 = never)."""

    name = "lru"

    def __init__(self, num_layers: int, num_experts: int):
        super().__init__(num_layers, num_experts)
        self._last_used = np.full(self.shape, -1.0)

    def update(self, counts: np.ndarray) -> None:
        # Only "was it used" matters for recency; how many tokens used it does not.
        np.copyto(self._last_used, self.step, where=counts > 0)

    def priority(self) -> np.ndarray:
        return self._last_used


class LFUPolicy(CachePolicy):
    """Least frequently used: priority = total tokens served since the start (no decay)."""

    name = "lfu"

    def __init__(self, num_layers: int, num_experts: int):
        super().__init__(num_layers, num_experts)
        self._total = np.zeros(self.shape)

    def update(self, counts: np.ndarray) -> None:
        self._total += counts

    def priority(self) -> np.ndarray:
        return self._total


class LFRUPolicy(CachePolicy):
    """Frequency with decay, weighed against recency.

    After each step: ``freq = decay * freq + counts``; ``recency`` = steps since the expert was
    last used (0 = used in the step just observed). Priority::

        freq / (1 + recency_weight * recency)

    Never-used experts have ``freq = 0`` and so the lowest priority. Frequency alone keeps
    experts that are hot on average (LRU thrashes them out when a few steps go elsewhere);
    the decay and the recency term let the cache follow a change of topic.

    ``decay`` and ``recency_weight`` are numbers, or arrays of shape ``[num_layers]`` for
    per-layer constants. Defaults were tuned on the GPT-OSS-20B trace's tuning split only
    (sequences from ``mmlu*`` datasets); see ``bench/results/replay_tuning.md`` and
    ``python -m bench.replay --tune``.
    """

    name = "lfru"
    DEFAULT_DECAY = 0.98  # tuned: bench/results/replay_tuning.md (GPT-OSS mmlu* only)
    DEFAULT_RECENCY_WEIGHT = 0.25

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        decay: float | np.ndarray = DEFAULT_DECAY,
        recency_weight: float | np.ndarray = DEFAULT_RECENCY_WEIGHT,
    ):
        super().__init__(num_layers, num_experts)
        self.decay = self._per_layer("decay", decay)
        self.recency_weight = self._per_layer("recency_weight", recency_weight)
        if not np.all((self.decay > 0.0) & (self.decay <= 1.0)):
            raise ValueError(f"lfru policy: expected 0 < decay <= 1, found decay={decay}")
        if not np.all(self.recency_weight >= 0.0):
            raise ValueError(
                f"lfru policy: expected recency_weight >= 0, found recency_weight={recency_weight}"
            )
        self._freq = np.zeros(self.shape)
        self._last_used = np.full(self.shape, -1.0)
        self._score = np.zeros(self.shape)

    def _per_layer(self, what: str, value) -> float | np.ndarray:
        """A float, or (per-layer constants) an array of shape [num_layers] kept as [L, 1]."""
        array = np.asarray(value, dtype=np.float64)
        if array.ndim == 0:
            return float(array)
        if array.shape != (self.num_layers,):
            raise ValueError(
                f"lfru policy: expected {what} to be a number or an array of shape "
                f"[num_layers] = [{self.num_layers}], found shape {list(array.shape)}"
            )
        return array[:, None]

    def update(self, counts: np.ndarray) -> None:
        self._freq *= self.decay
        self._freq += counts
        np.copyto(self._last_used, self.step, where=counts > 0)

    def priority(self) -> np.ndarray:
        recency = (self.step - 1) - self._last_used  # never used: freq is 0, recency irrelevant
        np.divide(self._freq, 1.0 + self.recency_weight * recency, out=self._score)
        return self._score

    def __repr__(self) -> str:
        return (
            f"LFRUPolicy(num_layers={self.num_layers}, num_experts={self.num_experts}, "
            f"decay={self.decay}, recency_weight={self.recency_weight})"
        )


class StaticPolicy(CachePolicy):
    """Pins, per layer, the experts with the highest frequency in a table given up front.

    ``frequency`` is ``[num_layers, num_experts]`` (a profile, a trace's tuning split, prefill
    counts ...). The pinned set of a cache of C slots is the C most frequent experts per layer
    (:func:`initial_residents`). It never changes: ``observe`` only advances the clock, and
    ``admits_misses = False`` tells the manager to serve a missed expert from scratch without
    evicting anything.
    """

    name = "static"
    admits_misses = False

    def __init__(self, num_layers: int, num_experts: int, frequency: np.ndarray | None = None):
        super().__init__(num_layers, num_experts)
        if frequency is None:
            raise ValueError(
                "static policy: expected frequency=<array [num_layers, num_experts]> of expert "
                "use counts (e.g. from a profile or a trace's tuning split), found none; pass "
                "make_policy('static', L, E, frequency=table)"
            )
        frequency = np.asarray(frequency, dtype=np.float64)
        if frequency.shape != self.shape:
            raise ValueError(
                f"static policy: expected frequency of shape {list(self.shape)}, "
                f"found {list(frequency.shape)}"
            )
        if not np.isfinite(frequency).all():
            raise ValueError("static policy: frequency table contains NaN or inf")
        self._frequency = frequency.copy()
        self._frequency.setflags(write=False)

    def update(self, counts: np.ndarray) -> None:
        pass  # a static cache learns nothing at run time, by definition

    def priority(self) -> np.ndarray:
        return self._frequency


# ----------------------------------------------------------------------------------------------
# The eviction rule, shared by the engine's manager and the trace replay.

_FLOAT_MAX = np.finfo(np.float64).max


def expert_counts(routing: np.ndarray, num_experts: int) -> np.ndarray:
    """routing int ``[L, ...]`` (expert ids, -1 = none) -> int64 ``[L, E]``: accesses per expert of each layer."""
    routing = np.asarray(routing)
    layers = routing.shape[0]
    flat = routing.reshape(layers, -1)
    valid = flat >= 0
    index = (np.arange(layers)[:, None] * num_experts + flat)[valid]
    return np.bincount(index, minlength=layers * num_experts).reshape(layers, num_experts)


def eviction_ranking(priority: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    """The eviction rule. int ``[L, E]``: per layer, expert ids in the order they are evicted: the
    ``candidate`` experts (bool ``[L, E]``) by ascending priority, equal priorities lower id first;
    then every other expert (never a victim)."""
    # Non-candidates sort after every candidate (key +inf; candidates' +inf priorities are clipped to
    # the largest finite float); the stable sort keeps equal keys in ascending id order.
    key = np.full(np.shape(priority), np.inf)
    np.minimum(priority, _FLOAT_MAX, out=key, where=candidate)
    return np.argsort(key, axis=-1, kind="stable")


def choose_victims(
    priority: np.ndarray,
    resident: np.ndarray,
    needed: np.ndarray,
    num_victims: np.ndarray | int,
) -> np.ndarray:
    """Vectorised eviction over layers.

    Args:
      priority: float ``[L, E]``, higher = more worth keeping.
      resident: bool ``[L, E]``, experts currently in a slot.
      needed: bool ``[L, E]``, experts the current step needs (never evicted).
      num_victims: int ``[L]`` (or a scalar), how many experts each layer must evict.

    Returns:
      bool ``[L, E]``: the victims, the first ``num_victims[l]`` of :func:`eviction_ranking` over the
      resident experts the step does not need.

    Raises ValueError when a layer has fewer evictable experts than it must evict.
    """
    priority = np.asarray(priority)
    num_layers, num_experts = priority.shape
    candidate = resident & ~needed
    num_victims = np.asarray(num_victims)
    if num_victims.ndim == 0:
        num_victims = np.full(num_layers, num_victims)
    evictable = candidate.sum(axis=1)
    if (evictable < num_victims).any():
        layer = int(np.flatnonzero(evictable < num_victims)[0])
        raise ValueError(
            f"choose_victims: layer {layer} must evict {int(num_victims[layer])} experts but only "
            f"{int(evictable[layer])} are resident and not needed by this step; the cache "
            f"must have at least as many slots as experts one step needs"
        )
    order = eviction_ranking(priority, candidate)
    take = np.arange(num_experts) < num_victims[:, None]  # the first num_victims sorted positions
    order += np.arange(0, num_layers * num_experts, num_experts)[:, None]  # flat indices
    victims = np.zeros(num_layers * num_experts, dtype=bool)
    victims[order[take]] = True
    return victims.reshape(num_layers, num_experts)


def initial_residents(priority: np.ndarray, capacity: int | np.ndarray) -> np.ndarray:
    """Bool ``[L, E]``: the ``capacity`` experts per layer (a scalar, or int ``[L]``) the eviction rule
    would keep last.

    Used to fill the cache of a policy that does not admit misses (static). Consistent with
    :func:`choose_victims`: it is what remains after evicting ``E - capacity`` experts from a
    full cache when nothing is needed.
    """
    priority = np.asarray(priority)
    num_layers, num_experts = priority.shape
    capacity = np.broadcast_to(np.asarray(capacity), (num_layers,))
    if not ((0 <= capacity) & (capacity <= num_experts)).all():
        raise ValueError(
            f"initial_residents: expected 0 <= capacity <= num_experts={num_experts}, "
            f"found {capacity.tolist()}"
        )
    everything = np.ones(priority.shape, dtype=bool)
    nothing = np.zeros(priority.shape, dtype=bool)
    victims = choose_victims(priority, everything, nothing, num_experts - capacity)
    return ~victims


# ----------------------------------------------------------------------------------------------
# Registry.

_REGISTRY: dict[str, Callable[..., CachePolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "lfru": LFRUPolicy,
    "static": StaticPolicy,
}


def policy_names() -> list[str]:
    """The names ``make_policy`` knows."""
    return sorted(_REGISTRY)


def register_policy(name: str, factory: Callable[..., CachePolicy]) -> None:
    """Make ``make_policy(name, L, E, **kw)`` call ``factory(L, E, **kw)``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_policy: expected a non-empty name, found {name!r}")
    _REGISTRY[name.lower()] = factory


def make_policy(
    name: str | CachePolicy | type, num_layers: int, num_experts: int, **kwargs
) -> CachePolicy:
    """Build a policy by name (``"lru"``, ``"lfu"``, ``"lfru"``, ``"static"``, or registered),
    or accept a user's :class:`CachePolicy` instance / subclass.

    ``kwargs`` go to the constructor (``decay=``, ``recency_weight=`` for lfru;
    ``frequency=`` for static).
    """
    if isinstance(name, CachePolicy):
        if kwargs:
            raise ValueError(
                f"make_policy: got a policy instance and keyword arguments {sorted(kwargs)}; "
                f"configure the instance when constructing it instead"
            )
        if name.shape != (num_layers, num_experts):
            raise ValueError(
                f"make_policy: policy {name!r} is for [num_layers, num_experts] = "
                f"{list(name.shape)}, expected {[num_layers, num_experts]}"
            )
        return name
    if isinstance(name, type) and issubclass(name, CachePolicy):
        return name(num_layers, num_experts, **kwargs)
    if not isinstance(name, str):
        raise ValueError(
            f"make_policy: expected a policy name or a CachePolicy, found {type(name).__name__}"
        )
    return policy_factory(name)(num_layers, num_experts, **kwargs)


def policy_factory(name: str) -> Callable[..., CachePolicy]:
    """The registered constructor for ``name``; an unknown name is a ValueError listing the known ones."""
    factory = _REGISTRY.get(name.lower())
    if factory is None:
        raise ValueError(
            f"unknown cache policy {name!r}; known policies: {', '.join(policy_names())} "
            f"(or pass a CachePolicy subclass instance)"
        )
    return factory
