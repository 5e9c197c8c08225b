"""Offload engine: placement, host store, slots, policies, manager."""
