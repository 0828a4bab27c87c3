"""Where bytes live: S3, the Hub, the local step store, content digests and credentials."""
