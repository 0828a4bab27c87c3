"""Prefect-side coordination: heavy work in child processes, fleet-wide locks, GPU slots, routing."""
