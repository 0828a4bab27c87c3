"""A run's record: the manifest, the report and progress of long work."""
