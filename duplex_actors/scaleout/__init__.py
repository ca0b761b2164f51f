"""Running duplex_actors across machines (Ray Serve)."""
