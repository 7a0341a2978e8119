"""On-disk layer of the message store: record format, segment files."""
