"""Capacity planning from real traffic (``loraplex plan``): replay the gateways' access logs
through the router's ring and the engine's own eviction policy for a range of fleet sizes."""
