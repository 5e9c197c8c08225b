"""The offload runtime: options, placement, device slots, the cache manager and its policies, and the
expert engines (resident, offloaded) that the jitted steps call."""
