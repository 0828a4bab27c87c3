"""The spec: its sections, how it is loaded and checked, and the specs one host's stack serves together."""
