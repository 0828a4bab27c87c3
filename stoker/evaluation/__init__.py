"""Accuracy evaluation of a served build before it is promoted (issue 12): perplexity on held-out text,
greedy agreement with the unquantized build of the same revision, and an optional lm-evaluation-harness task."""
