"""Triton: the model repository, its config.pbtxt rendering, its metrics and the python-backend models."""
