"""The main job: simulated callers in full-duplex conversation with an engine, live."""
