"""A deployment's life above the serving mechanics: rollout strategies, built on the targets, and the way back."""
